"""Rank 0 of a tensor- or pipeline-parallel engine, in the engine process (vLLM V0's driver worker), and
the other ranks' processes.

``TPDriver.start`` spawns ranks 1 .. N-1 (server/executor/tp_worker.py), joins the group with them and
watches them. The model runner (server/worker/model_runner.py) then sends each model call through it
before running its own part: ``forward(inputs)`` (the step's inputs, whole, to every rank of every
stage) and ``logits(hidden)`` (the rows whose logits rank 0 needs, to the first stage's ranks); every
rank runs the same collectives in the same order. Rank 0 is the first stage's tensor-parallel rank 0: it
holds the embedding and the head, and the last stage hands it the final hidden rows
(server/models/decoder.py ``DecoderModel.forward``).

A rank that dies ends the engine: a thread waits on the workers' sentinels, logs which rank died and
calls ``on_death`` (the server stops, server/engine/async_engine.py); a collective already waiting on the
dead rank fails (gloo sees the closed connection; every collective also has the group's timeout). The
workers watch their parent in turn, so a dead engine leaves no orphans.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import socket
import threading
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
from pagedserve.server.distributed.collectives import broadcast_tensor
from pagedserve.server.distributed.messages import Command, move_tensors
from pagedserve.server.distributed.parallel_state import PipelineStage, TensorParallel
from pagedserve.server.exceptions import RankDiedError
from pagedserve.server.executor.node_link import NodeLinks
from pagedserve.server.executor.tp_worker import (
    KVBudgetRequest,
    RunnerSetup,
    WorkerSpec,
    init_group,
    kv_budget,
    run_worker,
)

logger = logging.getLogger("pagedserve.tp")

# Every collective's bound: generous, since a rank may still be loading its shard of a large model when
# rank 0 first sends. A dead rank is noticed at once through its sentinel, not through this.
TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 10.0


class TPDriver:
    def __init__(self, spec: WorkerSpec, workers: list[Any], tp: TensorParallel,
                 stage: PipelineStage, links: NodeLinks | None = None) -> None:
        self.spec, self.workers, self.tp, self.stage = spec, workers, tp, stage
        self.links = links  # the other nodes' links (--nnodes), watched as the local ranks are
        self.on_death: Callable[[str], None] | None = None
        self.death: str | None = None  # why the engine cannot go on, once a rank died
        self._stopping = False
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        atexit.register(self.stop)

    @classmethod
    def start(cls, spec: WorkerSpec, link_port: int = 0) -> TPDriver:
        """Spawn this node's ranks 1 .. ranks_per_node-1 and join the group as rank 0 (ValueError if a
        group already exists); with several nodes, first listen on ``link_port`` for their links."""
        if dist.is_initialized():
            raise ValueError("one parallel engine per process: a process group already exists")
        links = NodeLinks(link_port, spec.nnodes) if spec.nnodes > 1 else None
        workers = spawn_ranks(spec, range(1, spec.ranks_per_node))
        logger.info("%d ranks (%d pipeline stages of %d tensor-parallel ranks) on %d nodes, local workers %s",
                    spec.size, spec.size // spec.ranks_per_stage, spec.ranks_per_stage, spec.nnodes,
                    [w.pid for w in workers])
        try:
            tp, stage = _join_watching(spec, workers)
            if links is not None:
                links.wait_all()
        except BaseException:
            for worker in workers:
                worker.kill()
            if links is not None:
                links.close()
            raise
        return cls(spec, workers, tp, stage, links)

    # ---- each model call, to every rank -------------------------------------------------------------

    def forward(self, inputs: Any) -> None:
        """The other ranks run ``inputs`` (a dataclass of tensors) as rank 0 is about to."""
        self._send(Command("forward", inputs=move_tensors(inputs, "cpu")))

    def logits(self, hidden: torch.Tensor) -> None:
        """The first stage's other ranks compute their vocabulary slice of ``hidden``'s logits (rank 0 is
        about to); nothing to do where that stage is rank 0 alone."""
        if self.tp.size == 1:
            return
        self._send(Command("logits", shape=tuple(hidden.shape), dtype=hidden.dtype))
        broadcast_tensor(hidden.contiguous(), self.tp)

    def kv_budget(self, model: torch.nn.Module, request: KVBudgetRequest) -> int:
        self._send(Command("kv_budget", inputs=request))
        return kv_budget(model, request)

    def setup(self, setup: RunnerSetup) -> None:
        self._send(Command("setup", inputs=setup))

    def start_kv_transfer(self, host: str) -> None:
        """The other ranks register their caches with transfer engines on ``host``; ``gather`` follows."""
        self._send(Command("kv_transfer", inputs=host))

    def start_load_kv(self, metadata: Any) -> None:
        """The other ranks' KV connector workers make their part of a step's transfers (rank 0 is about to);
        ``gather`` follows, with each rank's results."""
        self._send(Command("kv_connectors", inputs=metadata))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's answer to the last command, rank 0's ``value`` first."""
        values: list[Any] = [None] * self.spec.size
        dist.all_gather_object(values, value)
        return values

    def _send(self, command: Command) -> None:
        self.check_alive()
        try:
            dist.broadcast_object_list([command], src=0)
        except Exception as exc:
            self.check_alive()
            raise RankDiedError(f"a collective between the engine's ranks failed: {exc}") from exc

    def check_alive(self) -> None:
        """RankDiedError once a rank has died."""
        if self.death is None:
            for rank, worker in enumerate(self.workers, start=1):
                if worker.exitcode is not None:
                    self.death = _death_message(self.spec, rank, worker)
        if self.death is not None:
            raise RankDiedError(self.death)

    # ---- lifetime -----------------------------------------------------------------------------------

    def _watch(self) -> None:
        sockets = self.links.sockets if self.links is not None else {}
        ready = wait([worker.sentinel for worker in self.workers] + list(sockets))
        if self._stopping:
            return
        lost = [node for sock, node in sockets.items() if sock in ready]
        if self.links is not None and lost:
            self.death = self.links.lost_message(lost[0], self.spec)
        else:
            rank, worker = next((r, w) for r, w in enumerate(self.workers, start=1) if w.sentinel in ready)
            worker.join(1.0)  # its sentinel closes as it dies, a moment before its exit code can be read
            self.death = _death_message(self.spec, rank, worker)
        logger.error("%s; the engine cannot go on", self.death)
        if self.on_death is not None:
            self.on_death(self.death)

    def stop(self) -> None:
        """Tell the ranks to stop, wait for them (then kill what is left) and leave the group."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.stop)
        if self.death is None and all(w.is_alive() for w in self.workers):
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([Command("stop")], src=0)
        for worker in self.workers:
            # After a death the others may wait on the dead rank in a collective: no point waiting.
            worker.join(0 if self.death is not None else STOP_TIMEOUT_S)
            if worker.is_alive():
                worker.kill()
                worker.join()
        if self.links is not None:
            if self.death is None:
                # The other nodes' ranks leave the group first: a node's rank still tearing down its gloo
                # pairs when this end vanished once aborted (exit -6), and its node exited 1 in a clean stop.
                self.links.wait_closed(STOP_TIMEOUT_S)
            self.links.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def make_spec(fields: dict[str, Any], size: int, tp_size: int, nnodes: int = 1,
              master_addr: str = "127.0.0.1", master_port: int = 0) -> WorkerSpec:
    """Every rank's spec: the group at ``master_addr:master_port`` (0: a free loopback port, one node)."""
    port = master_port or _free_port()
    return WorkerSpec(**fields, size=size, init_method=f"tcp://{master_addr}:{port}", timeout_s=TIMEOUT_S,
                      tp_size=tp_size, nnodes=nnodes)


def spawn_ranks(spec: WorkerSpec, ranks: Iterable[int]) -> list[Any]:
    """One started process per rank (multiprocessing's spawn: no state inherited from this process)."""
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=run_worker, args=(rank, spec), name=f"pagedserve-rank{rank}", daemon=True)
        for rank in ranks
    ]
    for worker in workers:
        worker.start()
    return workers


def _free_port() -> int:
    """A loopback port for rank 0's store (the kernel's pick; the ranks are all on this machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _death_message(spec: WorkerSpec, rank: int, worker: Any) -> str:
    return f"{spec.describe(rank)} (pid {worker.pid}) exited with code {worker.exitcode}"


def _join_watching(spec: WorkerSpec, workers: list[Any]) -> tuple[TensorParallel, PipelineStage]:
    """Join the group as rank 0, failing at once (not at the timeout) if a worker dies meanwhile."""
    result: list[tuple[TensorParallel, PipelineStage] | BaseException] = []

    def join() -> None:
        try:
            result.append(init_group(spec, 0))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=join, name="tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        for rank, worker in enumerate(workers, start=1):
            if worker.exitcode is not None:
                raise RuntimeError(f"{_death_message(spec, rank, worker)} while starting")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]
