"""The executor: everything that runs the model, set up once and driven one step at a time (vLLM V1's
Executor, vllm/v1/executor/).

It owns the weights (this rank's shard under tensor and pipeline parallelism, whose other ranks it starts
and joins, server/executor/tp_driver.py), the KV cache's size (what fits beside the weights and a
profiled step on a GPU, a fixed budget on the CPU, the host tier's share), the model runner
(server/worker/model_runner.py) with its LoRA slots and drafter, and ``launch``: one scheduled step in,
each sampled request's tokens out.
The engine core (server/engine/core.py) sees only this object: no set-up and no per-feature branch of
the runner's reaches the core's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pagedserve.server.backend import select_backend
from pagedserve.server.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from pagedserve.server.core.scheduler import SchedulerOutput
from pagedserve.server.lora_request import LoRALoadError, LoRARequest
from pagedserve.server.worker.model_runner import LaunchedStep, ModelRunner

if TYPE_CHECKING:
    from pagedserve.server.backend import Backend
    from pagedserve.server.core.kv_connector import ConnectorMetadata, ConnectorResults
    from pagedserve.server.executor.tp_driver import TPDriver
    from pagedserve.server.executor.tp_worker import WorkerSpec
    from pagedserve.server.kv_transfer_params import KVLayout
    from pagedserve.server.lora.manager import LoRAManager
    from pagedserve.server.lora.peft import AdapterWeights
    from pagedserve.server.worker.kv_connector_workers import KVConnectorWorker

logger = logging.getLogger("pagedserve.engine")


def resolve_model_and_backend(config: EngineConfig) -> tuple[Path, Backend]:
    """The model folder and the kernel backend that run, recorded in the config (the front end's processor
    and /version read them back): the same on every node of a multi-node engine."""
    from pagedserve.server.loader import load_config, resolve_model
    from pagedserve.server.loader.pooler_config import resolve_runner

    model_path = Path(resolve_model(config.model))
    config.runner = resolve_runner(config.runner, model_path, load_config(model_path))
    backend = select_backend(config.torch_device, config.torch_dtype, config.attention_backend,
                             config.torch_kv_cache_dtype)
    config.attention_backend = backend.name  # what runs, after any fallback
    return model_path, backend


def ranks_spec(config: EngineConfig, model_path: Path, backend: Backend) -> WorkerSpec:
    """What every rank builds its shard from; a model that does not split across the ranks is refused
    first, naming its head or layer counts, before any process starts."""
    from pagedserve.server.executor.tp_driver import make_spec
    from pagedserve.server.loader import load_config
    from pagedserve.server.models.registry import check_pipeline_parallel, check_tensor_parallel

    hf_config = load_config(model_path)
    check_tensor_parallel(hf_config, config.tensor_parallel_size)
    check_pipeline_parallel(hf_config, config.pipeline_parallel_size)
    fields = dict(model_path=str(model_path), dtype=config.torch_dtype, device_type=config.torch_device.type,
                  backend=backend.name, kv_cache_dtype=config.torch_kv_cache_dtype, seed=config.seed,
                  runner=config.runner, load_format=config.load_format)
    return make_spec(fields, config.world_size, config.tensor_parallel_size, config.nnodes,
                     config.master_addr, config.master_port)


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        """Weights, the KV cache size that fits beside them, max_model_len, and the model runner; under
        tensor parallelism the other ranks first (each loads its own shard meanwhile)."""
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.kv_cache_dtype = config.torch_kv_cache_dtype
        self.model_path, self.backend = resolve_model_and_backend(config)
        self.ranks = self._start_ranks()
        try:
            self._load_shard_and_runner()
        except BaseException:
            self.shutdown()
            raise
        self.async_scheduling = self._runs_ahead()
        config.async_scheduling = self.async_scheduling  # what runs, resolved: /version shows it
        logger.info(
            "engine ready: model=%s device=%s dtype=%s backend=%s kv_cache_dtype=%s "
            "kv_blocks=%d x %d tokens, host kv_blocks=%d, max_model_len=%d, async scheduling=%s",
            self.model_path, self.device, self.dtype, self.backend.name, self.kv_cache_dtype,
            self.num_blocks, config.block_size, self.num_host_blocks, config.max_model_len,
            self.async_scheduling,
        )

    # ---- set-up -------------------------------------------------------------------------------------

    def _start_ranks(self) -> TPDriver | None:
        """The other ranks (tensor-parallel, and every later pipeline stage's), started and joined; None on
        one rank. A model that does not split across them is refused first, naming its head or layer
        counts, before any process starts."""
        config = self.config
        if config.world_size == 1:
            return None
        from pagedserve.server.executor.node_link import link_port
        from pagedserve.server.executor.tp_driver import TPDriver

        spec = ranks_spec(config, self.model_path, self.backend)
        return TPDriver.start(spec, link_port(config.master_port))

    def _load_shard_and_runner(self) -> None:
        """This rank's model (its shard under tensor parallelism), the KV cache, the runner."""
        from pagedserve.server.loader import load_model

        config = self.config
        self.model, self.hf_config = load_model(
            self.model_path, self.dtype, self.device, backend=self.backend, quantization=config.quantization,
            tp=self.ranks.tp if self.ranks is not None else None,
            stage=self.ranks.stage if self.ranks is not None else None, runner=config.runner,
            load_format=config.load_format,
        )
        # A vision-language config holds the decoder's numbers in its text config (a text one is its own)
        self.text_config = self.hf_config.get_text_config()
        self.vocab_size = int(self.text_config.vocab_size)
        self.lora = self._make_lora_manager()
        self.draft_model = self._load_draft_model()
        # This rank's KV heads and layers: a shard of every block under tensor parallelism, its stage's
        # layers under pipeline parallelism. The first stage holds the most layers (PipelineStage's
        # split), so its block bytes bound every stage's, and the ranks allocate the blocks it counts.
        layer = self.model.attention_layers()[0]
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        self.block_bytes = sum(
            ModelRunner.bytes_per_block(1, config.block_size, layer.num_kv_heads, layer.head_dim,
                                        self.kv_cache_dtype)
            for layer in self._kv_layers()
        )
        self.num_blocks = self._num_blocks(self.block_bytes)
        self.num_host_blocks = self._num_host_blocks(self.block_bytes)
        self._resolve_max_model_len()
        if self.ranks is not None:
            from pagedserve.server.executor.tp_worker import RunnerSetup

            self.ranks.setup(RunnerSetup(self.num_blocks, config.block_size, config.max_num_seqs,
                                         config.max_model_len or 0, self.num_host_blocks))
        self.runner = ModelRunner(
            self.model,
            self.backend,
            self.num_blocks,
            config.block_size,
            num_kv_heads,
            head_dim,
            self.kv_cache_dtype,
            self.device,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len or 0,
            # CUDA graphs do not capture the ranks' commands: tensor parallelism runs eagerly, for now.
            # A pooling runner never decodes, so it has no graph to replay.
            # Multimodal RoPE's [3, T] positions are not what the decode graphs capture.
            enforce_eager=(config.enforce_eager or self.lora is not None or self.ranks is not None
                           or config.runner == "pooling" or self.model.uses_mrope),
            calculate_kv_scales=config.calculate_kv_scales,
            lora=self.lora,
            ranks=self.ranks,
            draft_model=self.draft_model,
        )
        self.kv_workers = self._kv_connector_workers()

    def _kv_connector_workers(self) -> dict[str, KVConnectorWorker]:
        """Rank 0's worker of each KV connector (server/worker/kv_connector_workers.py), by name; the other
        ranks make theirs (server/executor/tp_worker.py). Under prefill/decode disaggregation every rank
        registers its cache with a transfer engine, and ``kv_layouts`` holds each rank's, in rank order:
        what a prefill engine publishes and what a decode engine reads by."""
        from pagedserve.server.worker.kv_connector_workers import MooncakeWorker, OffloadingWorker

        workers: dict[str, KVConnectorWorker] = {}
        self.kv_layouts: tuple[KVLayout, ...] = ()
        if self.num_host_blocks:
            workers[OffloadingWorker.name] = OffloadingWorker(self.model, self.num_host_blocks,
                                                              self.kv_cache_dtype, self.device)
        if (transfer := self.config.kv_transfer_config) is not None:
            if self.ranks is not None:
                self.ranks.start_kv_transfer(transfer.kv_ip)
            mooncake = workers[MooncakeWorker.name] = MooncakeWorker(self.model, transfer.kv_ip, rank=0)
            layouts = self.ranks.gather(mooncake.layout) if self.ranks is not None else [mooncake.layout]
            self.kv_layouts = tuple(layouts)
        return workers

    def _kv_layers(self) -> list[torch.nn.Module]:
        """Every attention layer with a cache of the shared blocks: the target's, then the drafter's (so a
        block's bytes, and the KV budget, count both)."""
        draft = self.draft_model.attention_layers() if self.draft_model is not None else []
        return [*self.model.attention_layers(), *draft]

    def _load_draft_model(self) -> torch.nn.Module | None:
        """speculative_config's draft model (method "draft_model"), by the target's loader, dtype and
        backend; None for the other methods (server/config.py refuses it where its cache cannot follow the
        target's: tensor parallelism, the host KV tier)."""
        spec = self.config.speculative_config
        if spec is None or not spec.uses_draft_model:
            return None
        from pagedserve.server.loader import load_config, load_model, resolve_model
        from pagedserve.server.spec_decode.draft_model import check_draft_config

        path = resolve_model(spec.model)
        check_draft_config(self.hf_config, load_config(path))
        model, _ = load_model(path, self.dtype, self.device, backend=self.backend)
        return model

    def _make_lora_manager(self) -> LoRAManager | None:
        """The adapters' slots and caches, and the ``lora_modules`` read at start; None without LoRA."""
        config = self.config
        if not config.enable_lora:
            return None
        from pagedserve.server.lora.manager import LoRAManager

        assert config.max_cpu_loras is not None  # resolved by EngineConfig
        manager = LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        # The token -> slot mapping changes with every step's batch; CUDA graphs would need it in a static
        # buffer, so for now LoRA runs eagerly.
        if self.device.type == "cuda" and not config.enforce_eager:
            logger.info("LoRA is enabled: CUDA graphs are off (the adapter mapping is per step)")
        for index, module in enumerate(config.lora_modules or [], start=1):
            manager.add(LoRARequest(module.name, index, module.path))
        return manager

    def _num_blocks(self, block_bytes: int) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes is below one block ({block_bytes} bytes)")
        return int(num_blocks)

    def _num_host_blocks(self, block_bytes: int) -> int:
        """The host KV tier's blocks (server/core/host_tier.py): its budget in whole blocks; 0 when off.
        ``block_bytes`` is one rank's shard of a block, and the budget is every rank's together (vLLM's
        kv_offloading_size), so each rank holds its share."""
        budget = self.config.kv_offload_bytes // self.config.world_size
        if not budget:
            return 0
        if budget < block_bytes:
            raise ValueError(f"kv_offloading_size of {budget} bytes is below one block ({block_bytes} bytes)")
        return budget // block_bytes

    def _gpu_kv_budget(self) -> int:
        """What is left of ``gpu_memory_utilization`` after the weights and a profiled largest step."""
        from pagedserve.server.worker.cuda_graphs import kv_cache_budget, profile_activation_peak

        if self.ranks is not None:  # every rank profiles its own shard; the smallest budget is everyone's
            from pagedserve.server.executor.tp_worker import KVBudgetRequest

            request = KVBudgetRequest(self.config.batched_tokens, self.config.max_num_seqs,
                                      self.config.gpu_memory_utilization)
            return self.ranks.kv_budget(self.model, request)
        peak = profile_activation_peak(self.model, self.config.batched_tokens, self.config.max_num_seqs)
        return kv_cache_budget(self.device, self.config.gpu_memory_utilization, peak)

    def _resolve_max_model_len(self) -> None:
        cfg = self.config
        model_limit = int(getattr(self.text_config, "max_position_embeddings", 2048))
        capacity = self.num_blocks * cfg.block_size
        if cfg.max_model_len is None:
            cfg.max_model_len = min(model_limit, capacity)
        elif cfg.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings {model_limit}"
            )
        elif cfg.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} does not fit the KV cache ({capacity} "
                "tokens); raise kv_cache_memory_bytes or lower max_model_len"
            )

    # ---- running ------------------------------------------------------------------------------------

    def _runs_ahead(self) -> bool:
        """vLLM's --async-scheduling (default: on a GPU, where it hides the host's work): a step launched
        while the one before is in flight. Only where each step's inputs are the device's to take: on one
        rank (the others would need the sampled tokens too), without LoRA slots, drafts or a host KV tier,
        whose per-step work reads the sequences as the host knows them."""
        wanted = self.config.async_scheduling
        if wanted is None:
            wanted = self.device.type == "cuda"
        return wanted and self.ranks is None and self.lora is None and not self.num_host_blocks and (
            self.config.speculative_config is None
        )

    def launch(self, plan: SchedulerOutput, block_ids: dict[str, list[int]], active_loras: set[int] | None,
               previous: LaunchedStep | None = None) -> LaunchedStep:
        """The step queued on the device, its tokens read back later by ``LaunchedStep.result``;
        ``previous``: the step still in flight, whose tokens feed this one's rows with ``num_in_flight``."""
        return self.runner.launch(plan.scheduled, block_ids, active_loras, previous)

    def run_kv_connectors(self, metadata: ConnectorMetadata) -> ConnectorResults:
        """A step's KV connector transfers, made by every rank's workers before the step runs; each
        connector's results, one per rank in rank order (server/core/kv_connector.py reads them)."""
        from pagedserve.server.worker.kv_connector_workers import start_load_kv

        if self.ranks is not None:
            self.ranks.start_load_kv(metadata)
        own = start_load_kv(self.kv_workers, metadata)
        answers = self.ranks.gather(own) if self.ranks is not None else [own]
        return {name: [answer[name] for answer in answers] for name in metadata}

    def check_alive(self) -> None:
        """RankDiedError (an EngineDeadError) once another rank has died."""
        if self.ranks is not None:
            self.ranks.check_alive()

    def on_death(self, callback: Callable[[str], None]) -> None:
        """``callback(message)`` from the ranks' watcher thread when one dies (never on one rank)."""
        if self.ranks is not None:
            self.ranks.on_death = callback

    def shutdown(self) -> None:
        """Stop the other ranks (nothing to do on one rank)."""
        if self.ranks is not None:
            self.ranks.stop()

    # ---- adapters -----------------------------------------------------------------------------------

    def load_lora(self, lora: LoRARequest) -> AdapterWeights:
        """Read and check an adapter's weights (LoRALoadError with the reason); registers nothing."""
        if self.lora is None:
            raise LoRALoadError("LoRA is not enabled: start the engine with --enable-lora.")
        return self.lora.load(lora)

    def add_lora(self, lora: LoRARequest, weights: AdapterWeights | None = None) -> None:
        """Register an adapter (``weights`` read already by ``load_lora``, else read here)."""
        if self.lora is None:
            raise LoRALoadError("LoRA is not enabled (--enable-lora)")
        self.lora.add(lora, weights)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def registered_loras(self) -> dict[int, LoRARequest]:
        """The adapters the runner can load into a slot, by id (empty without LoRA)."""
        return dict(self.lora.registered) if self.lora is not None else {}
