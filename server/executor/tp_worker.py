"""A rank other than 0: its own process, its shard of the model (its tensor-parallel slice of its pipeline
stage's layers) and of every KV block.

``run_worker`` is the process's entry (multiprocessing's spawn context, server/executor/tp_driver.py). It
joins the group, loads its shard, then does what rank 0 tells it, command by command, until ``stop``:
the same forward passes over the same step inputs (a later pipeline stage takes its activations from the
stage before), and, on the first stage, its vocabulary slice of each logits request. It samples nothing:
rank 0 holds the whole logits. It exits when the engine process dies (a thread watches
its parent), and when a collective fails because another rank died.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pagedserve.server.distributed.collectives import broadcast_tensor
from pagedserve.server.distributed.messages import Command, move_tensors
from pagedserve.server.distributed.parallel_state import PipelineStage, TensorParallel

logger = logging.getLogger("pagedserve.tp")

PARENT_POLL_S = 0.5


@dataclass
class WorkerSpec:
    """What every rank needs to build its shard: the driver's choices, so all ranks run alike."""

    model_path: str
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda": rank r runs on cuda:r
    backend: str  # server/backend.py's name of what rank 0 runs
    kv_cache_dtype: torch.dtype
    seed: int
    size: int  # every rank of the engine: tp_size in each pipeline stage
    init_method: str  # tcp://127.0.0.1:PORT, rank 0's store
    timeout_s: float
    runner: str = "generate"  # "pooling": no LM head (server/loader/weights.py load_model)
    load_format: str = "auto"  # "dummy": random weights
    tp_size: int = 0  # the ranks of one pipeline stage; 0: all of them (one stage)
    nnodes: int = 1  # machines the ranks are spread over, size // nnodes on each (--nnodes)

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def ranks_per_stage(self) -> int:
        return self.tp_size or self.size

    def describe(self, rank: int) -> str:
        """How log lines and errors name ``rank``: its tensor-parallel rank, and its stage when there are
        several."""
        if self.ranks_per_stage == self.size:
            return f"tensor-parallel rank {rank}"
        return f"rank {rank} (pipeline stage {rank // self.ranks_per_stage})"


@dataclass
class RunnerSetup:
    """The KV cache and batch limits rank 0 settled on after loading (every rank allocates alike)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    num_host_blocks: int = 0  # the host KV tier's blocks (server/core/host_tier.py), each rank its shard


@dataclass
class KVBudgetRequest:
    """CUDA: each rank profiles its largest step; the smallest budget of all ranks is everyone's."""

    num_tokens: int
    num_seqs: int
    gpu_memory_utilization: float


def rank_device(spec: WorkerSpec, rank: int) -> torch.device:
    """Rank r's device: GPU r on its machine (ranks are numbered node by node), or the CPU."""
    local = rank % spec.ranks_per_node
    return torch.device("cuda", local) if spec.device_type == "cuda" else torch.device("cpu")


def init_group(spec: WorkerSpec, rank: int) -> tuple[TensorParallel, PipelineStage]:
    """Join the group (NCCL between GPUs, gloo on the CPU) and, under pipeline parallelism, every stage's
    tensor-parallel group (each rank creates all of them, in order, as torch.distributed requires)."""
    from datetime import timedelta

    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank_device(spec, rank))
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=spec.size,
                            timeout=timedelta(seconds=spec.timeout_s))
    per_stage = spec.ranks_per_stage
    stage = PipelineStage(rank // per_stage, spec.size // per_stage, rank % per_stage, per_stage)
    if per_stage == spec.size:
        return TensorParallel(rank, spec.size, dist.group.WORLD), stage
    group = None
    for index in range(stage.size):
        members = list(range(index * per_stage, (index + 1) * per_stage))
        created = dist.new_group(members) if per_stage > 1 else None
        if index == stage.index:
            group = created
    return TensorParallel(stage.tp_rank, per_stage, group), stage


def receive_command() -> Command:
    """Rank 0's next command, to every rank of every stage."""
    box: list[Command | None] = [None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def kv_budget(model: torch.nn.Module, request: KVBudgetRequest) -> int:
    """This rank's KV bytes after its profiled peak; the minimum over every rank (all must call it)."""
    from pagedserve.server.worker.cuda_graphs import kv_cache_budget, profile_activation_peak

    device = next(model.parameters()).device
    peak = profile_activation_peak(model, request.num_tokens, request.num_seqs)
    budget = torch.tensor([kv_cache_budget(device, request.gpu_memory_utilization, peak)], device=device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    return int(budget.item())


def _exit_with_parent() -> None:
    """No orphans: when the engine process is gone (its pid no longer our parent), leave at once."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_worker(rank: int, spec: WorkerSpec) -> None:
    """The process entry of rank ``rank`` (1 .. size - 1)."""
    _exit_with_parent()
    # Stopped by the engine process alone (its stop command, or its death): a Ctrl-C or SIGTERM sent to
    # the whole process group must let the engine drain first, not kill a rank under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    if spec.device_type == "cpu":
        # The ranks share the machine's cores: each takes its part, not all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.ranks_per_node))
    torch.manual_seed(spec.seed)
    tp, stage = init_group(spec, rank)
    try:
        with torch.inference_mode():
            _serve(rank, spec, tp, stage)
    finally:
        dist.destroy_process_group()


def _serve(rank: int, spec: WorkerSpec, tp: TensorParallel, stage: PipelineStage) -> None:
    from pagedserve.server.backend import select_backend
    from pagedserve.server.loader import load_model
    from pagedserve.server.worker.kv_connector_workers import (
        KVConnectorWorker,
        MooncakeWorker,
        OffloadingWorker,
        start_load_kv,
    )
    from pagedserve.server.worker.model_runner import ModelRunner

    device = rank_device(spec, rank)
    backend = select_backend(device, spec.dtype, spec.backend, spec.kv_cache_dtype)
    model, _ = load_model(spec.model_path, spec.dtype, device, backend=backend, tp=tp, stage=stage,
                          runner=spec.runner, load_format=spec.load_format)
    logger.info("%s of %d loaded its shard on %s", spec.describe(rank), spec.size, device)
    runner: ModelRunner | None = None
    kv_workers: dict[str, KVConnectorWorker] = {}  # this rank's KV connector workers, by connector name
    while True:
        command = receive_command()
        if command.kind == "stop":
            return
        if command.kind == "forward":
            assert runner is not None, "a forward before the KV cache was set up"
            runner.run_model(move_tensors(command.inputs, device))
        elif command.kind == "logits":
            if not stage.is_first:  # the head is on the first stage, beside the driver
                continue
            assert command.shape is not None and command.dtype is not None
            hidden = broadcast_tensor(torch.empty(command.shape, dtype=command.dtype, device=device), tp)
            model.compute_logits(hidden)
        elif command.kind == "kv_budget":
            kv_budget(model, command.inputs)
        elif command.kind == "kv_transfer":
            mooncake = kv_workers[MooncakeWorker.name] = MooncakeWorker(model, command.inputs, rank)
            dist.all_gather_object([None] * spec.size, mooncake.layout)
        elif command.kind == "kv_connectors":
            dist.all_gather_object([None] * spec.size, start_load_kv(kv_workers, command.inputs))
        elif command.kind == "setup":
            setup: RunnerSetup = command.inputs
            layer = model.attention_layers()[0]
            runner = ModelRunner(
                model, backend, setup.num_blocks, setup.block_size, layer.num_kv_heads, layer.head_dim,
                spec.kv_cache_dtype, device, max_num_seqs=setup.max_num_seqs,
                max_model_len=setup.max_model_len, enforce_eager=True,
            )
            if setup.num_host_blocks:
                kv_workers[OffloadingWorker.name] = OffloadingWorker(model, setup.num_host_blocks,
                                                                     spec.kv_cache_dtype, device)
        else:
            raise ValueError(f"unknown command {command.kind!r}")
