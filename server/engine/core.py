"""The engine core: schedule, run the model, sample. Token ids in, token ids out; no tokenizer here.

One ``step()`` schedules a batch, runs one forward pass, appends the sampled tokens and applies the
stops that are decided on token ids (EOS, stop_token_ids, a finished grammar, max_tokens, max_model_len),
then frees the blocks of finished requests. With ``speculative_config`` a request may gain several
tokens in a step (its accepted drafts and one more, server/spec_decode/); they are appended one by one
through the same stops, and the proposer then drafts for the next step. What each request gained comes
back as an ``EngineCoreOutput``; text, stop strings and logprob strings are made from those by
server/engine/output_processor.py, off the step thread (vLLM V1's EngineCore / front-end split).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pagedserve.server.backend import select_backend
from pagedserve.server.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from pagedserve.server.core.kv_cache_manager import KVCacheManager, uniform_sliding_window
from pagedserve.server.core.scheduler import Scheduler
from pagedserve.server.engine.core_output import EngineCoreOutput, EngineStats, KVOffloadStats, LoRAStats
from pagedserve.server.engine.exceptions import EngineDeadError, StepError
from pagedserve.server.lora.request import LoRALoadError, LoRARequest
from pagedserve.server.request import Request, RequestStatus
from pagedserve.server.spec_decode.metrics import SpecDecodingStats
from pagedserve.server.spec_decode.proposer import DraftProposer, record_acceptance
from pagedserve.server.worker.model_runner import ModelRunner
from pagedserve.server.worker.sampler import SampledToken

if TYPE_CHECKING:
    from pagedserve.server.distributed.driver import TPDriver
    from pagedserve.server.lora.manager import LoRAManager
    from pagedserve.server.lora.peft import AdapterWeights

logger = logging.getLogger("pagedserve.engine")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        torch.manual_seed(config.seed)
        if config.served_model_name is None:
            config.served_model_name = config.model or DEFAULT_SERVED_NAME
        self._load_model_and_runner()
        self.kv = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            hash_seed=f"{self.model_path}:{self.dtype}",
            sliding_window=uniform_sliding_window(self.model.attention_layers()),
            enable_kv_events=config.enable_kv_events,
            num_host_blocks=self.num_host_blocks,
        )
        max_loras = config.max_loras if self.lora is not None else 0
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.batched_tokens, max_loras)
        # finished requests per adapter name: pagedserve:lora_requests_total
        self.lora_requests_finished: dict[str, int] = {}
        self._check_unloaded = False  # an adapter was unloaded: fail the requests still waiting for it
        spec = config.speculative_config
        self.proposer = DraftProposer(spec, config.max_model_len or 0) if spec is not None else None
        self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens if spec is not None else 0)
        self.requests: dict[str, Request] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        logger.info(
            "engine ready: model=%s device=%s dtype=%s backend=%s kv_cache_dtype=%s "
            "kv_blocks=%d x %d tokens, host kv_blocks=%d, max_model_len=%d",
            self.model_path,
            self.device,
            self.dtype,
            self.backend.name,
            self.kv_cache_dtype,
            self.num_blocks,
            config.block_size,
            self.num_host_blocks,
            config.max_model_len,
        )

    # ---- set-up -------------------------------------------------------------------------------------

    def _load_model_and_runner(self) -> None:
        """Weights, the KV cache size that fits beside them, max_model_len, and the model runner; under
        tensor parallelism the other ranks first (each loads its own shard meanwhile)."""
        from pagedserve.server.loader import resolve_model

        config = self.config
        self.model_path = Path(resolve_model(config.model))
        self.kv_cache_dtype = config.torch_kv_cache_dtype
        self.backend = select_backend(self.device, self.dtype, config.attention_backend, self.kv_cache_dtype)
        config.attention_backend = self.backend.name  # what runs, after any fallback: /version shows it
        self.ranks = self._start_ranks()
        try:
            self._load_shard_and_runner()
        except BaseException:
            self.shutdown()
            raise

    def _start_ranks(self) -> TPDriver | None:
        """The other tensor-parallel ranks, started and joined; None on one rank. A model that does not
        split across them is refused first, naming its head counts, before any process starts."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return None
        from pagedserve.server.distributed.driver import TPDriver
        from pagedserve.server.distributed.parallel_state import check_tensor_parallel
        from pagedserve.server.loader import load_config

        check_tensor_parallel(load_config(self.model_path), size)
        spec = dict(model_path=str(self.model_path), dtype=self.dtype, device_type=self.device.type,
                    backend=self.backend.name, kv_cache_dtype=self.kv_cache_dtype, seed=self.config.seed)
        return TPDriver.start(spec, size)

    def _load_shard_and_runner(self) -> None:
        """This rank's model (its shard under tensor parallelism), the KV cache, the runner."""
        from pagedserve.server.loader import load_model

        config = self.config
        self.model, self.hf_config = load_model(
            self.model_path, self.dtype, self.device, backend=self.backend, quantization=config.quantization,
            tp=self.ranks.tp if self.ranks is not None else None,
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        self.lora = self._make_lora_manager()
        self.draft_model = self._load_draft_model()
        # This rank's KV heads: a shard of every block under tensor parallelism.
        layer = self.model.attention_layers()[0]
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        block_bytes = sum(
            ModelRunner.bytes_per_block(1, config.block_size, layer.num_kv_heads, layer.head_dim,
                                        self.kv_cache_dtype)
            for layer in self._kv_layers()
        )
        self.block_bytes = block_bytes
        self.num_blocks = self._num_blocks(block_bytes)
        self.num_host_blocks = self._num_host_blocks(block_bytes)
        self._resolve_max_model_len()
        if self.ranks is not None:
            from pagedserve.server.distributed.worker import RunnerSetup

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
            enforce_eager=config.enforce_eager or self.lora is not None or self.ranks is not None,
            calculate_kv_scales=config.calculate_kv_scales,
            lora=self.lora,
            ranks=self.ranks,
            num_host_blocks=self.num_host_blocks,
            draft_model=self.draft_model,
        )

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

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank)."""
        if getattr(self, "ranks", None) is not None:
            self.ranks.stop()

    def check_ranks(self) -> None:
        """RankDiedError (an EngineDeadError) once a tensor-parallel rank has died."""
        if self.ranks is not None:
            self.ranks.check_alive()

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

    # ---- adapters -----------------------------------------------------------------------------------

    def add_lora(self, lora: LoRARequest, weights: AdapterWeights | None = None) -> None:
        """Register an adapter (``weights`` read already by ``self.lora.load``, else read here)."""
        if self.lora is None:
            raise LoRALoadError("LoRA is not enabled (--enable-lora)")
        self.lora.add(lora, weights)

    def remove_lora(self, lora_int_id: int) -> None:
        """New requests cannot use it; running ones finish with it, waiting ones fail at the next step."""
        if self.lora is not None:
            self.lora.remove(lora_int_id)
            self._check_unloaded = True

    def list_loras(self) -> list[LoRARequest]:
        return list(self.lora.registered.values()) if self.lora is not None else []

    def _fail_unloaded(self) -> None:
        """Waiting requests whose adapter was unloaded fail, each alone, with the reason."""
        self._check_unloaded = False
        assert self.lora is not None
        registered = self.lora.registered
        gone = [r for r in self.scheduler.waiting if r.lora_int_id and r.lora_int_id not in registered]
        if gone:
            names = sorted({r.lora_request.lora_name for r in gone if r.lora_request is not None})
            self.abort_requests([r.request_id for r in gone])
            reason = f"LoRA adapter {', '.join(names)} was unloaded before the request ran"
            raise StepError([r.request_id for r in gone], LoRALoadError(reason))

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
        budget = self.config.kv_offload_bytes // self.config.tensor_parallel_size
        if not budget:
            return 0
        if budget < block_bytes:
            raise ValueError(f"kv_offloading_size of {budget} bytes is below one block ({block_bytes} bytes)")
        return budget // block_bytes

    def _gpu_kv_budget(self) -> int:
        """What is left of ``gpu_memory_utilization`` after the weights and a profiled largest step."""
        from pagedserve.server.worker.cuda_graphs import kv_cache_budget, profile_activation_peak

        if self.ranks is not None:  # every rank profiles its own shard; the smallest budget is everyone's
            from pagedserve.server.distributed.worker import KVBudgetRequest

            request = KVBudgetRequest(self.config.batched_tokens, self.config.max_num_seqs,
                                      self.config.gpu_memory_utilization)
            return self.ranks.kv_budget(self.model, request)
        peak = profile_activation_peak(self.model, self.config.batched_tokens, self.config.max_num_seqs)
        return kv_cache_budget(self.device, self.config.gpu_memory_utilization, peak)

    def _resolve_max_model_len(self) -> None:
        cfg = self.config
        model_limit = int(getattr(self.hf_config, "max_position_embeddings", 2048))
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

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request made by server/engine/processor.py (already validated)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.seed is not None and not request.params.greedy:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(request.seed)
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests (those still known) and return their blocks now."""
        now = time.time()
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                request.metrics.finished_time = now
                self._count_lora_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        if self._check_unloaded:
            self._fail_unloaded()
        plan = self.scheduler.schedule()
        if plan.empty:
            self.runner.copy_kv_blocks(plan.kv_transfers)  # none in practice: copies come with allocations
            return []
        block_ids = {s.request.request_id: self.kv.block_ids(s.request.request_id) for s in plan.scheduled}
        active_loras = self.scheduler.active_loras() if self.lora is not None else None
        try:
            sampled = self.runner.execute(plan.scheduled, block_ids, active_loras, plan.kv_transfers)
        except EngineDeadError:
            raise  # a tensor-parallel rank died: no step can run again
        except Exception as exc:
            self.check_ranks()  # a collective failed because a rank died: that, not this step, is the error
            raise self._fail_step([s.request for s in plan.scheduled], exc) from exc
        for item in plan.scheduled:
            # Drafts count as computed only once accepted, below: a rejected draft's KV slot is rewritten.
            item.request.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)
            item.request.spec_token_ids = []
        drafts = {s.request.request_id: s.spec_token_ids for s in plan.scheduled if s.spec_token_ids}
        now = time.time()
        outputs = []
        failed: dict[str, Exception] = {}
        for request, tokens in sampled:
            if isinstance(tokens, Exception):  # its row alone failed (server/worker/sampler.py sample_each)
                failed[request.request_id] = tokens
                continue
            if request.request_id in drafts:
                self._record_drafts(request, drafts[request.request_id], len(tokens) - 1)
            appended = self._append_tokens(request, tokens, now)
            if isinstance(appended, Exception):
                failed[request.request_id] = appended
                continue
            if request.finished:
                self.scheduler.finish(request, request.status)
                del self.requests[request.request_id]
                self._count_lora_request(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[token.token_id for token in appended],
                    new_logprobs=appended if request.params.logprobs is not None else None,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    metrics=request.metrics,
                    # Complete once the first token is sampled, and sent with it, once.
                    prompt_logprobs=request.prompt_logprobs
                    if request.num_output_tokens == len(appended) else None,
                )
            )
        if failed:
            # Only these fail: the forward pass went well, so the cached prefixes stay (unlike _fail_step),
            # and the other requests' outputs of this step travel with the error to the front end.
            cause = next(iter(failed.values()))
            self.abort_requests(list(failed))
            raise StepError(list(failed), cause, outputs) from cause
        if self.proposer is not None:
            self.proposer.propose([r for r, _ in sampled if r.request_id in self.requests],
                                  len(self.scheduler.running))
        return outputs

    def _append_tokens(self, request: Request, tokens: list[SampledToken],
                       now: float) -> list[SampledToken] | Exception:
        """Append a step's tokens in order until one of them finishes the request; those after it are
        dropped. Accepted drafts count as computed (their KV was written while verifying them)."""
        if len(tokens) == 1 and request.grammar is None:  # most rows: one token, no grammar to consult
            self._append_token(request, tokens[0], now)
            return tokens
        appended: list[SampledToken] = []
        for token in tokens:
            if appended:
                request.num_computed_tokens += 1  # the previous token was an accepted draft
            if request.grammar is not None and not request.grammar.accept(token.token_id):
                return RuntimeError(f"the grammar refused token {token.token_id}: {request.grammar.error}")
            appended.append(token)
            if self._append_token(request, token, now):
                break
        return appended

    def _record_drafts(self, request: Request, drafts: list[int], num_accepted: int) -> None:
        self.spec_stats.record(len(drafts), num_accepted)
        record_acceptance(request, len(drafts), num_accepted)

    def _fail_step(self, requests: list[Request], exc: BaseException) -> StepError:
        logger.exception("engine step failed; aborting %d requests", len(requests))
        request_ids = [r.request_id for r in requests]
        self.abort_requests(request_ids)
        # Blocks registered for this step may hold half-written K/V (and host blocks half-copied ones):
        # forget every cached prefix, in both tiers.
        self.kv.reset_prefix_cache()
        return StepError(request_ids, exc)

    def _append_token(self, request: Request, token: SampledToken, now: float) -> bool:
        """Append a token (the grammar, if any, took it already) and apply the stops on token ids; True
        when it finished the request.

        A complete grammar admits only EOS; taking it ends the request with "stop", even with
        ignore_eos. max_tokens reached before that ends it with "length", its structured output cut
        mid-way (a JSON text then does not parse).
        """
        output_ids = request.output_token_ids
        if not output_ids:
            request.metrics.first_token_time = now
            self.prompt_tokens += len(request.prompt_token_ids)
        request.metrics.last_token_time = now
        self.generation_tokens += 1
        token_id = token.token_id
        output_ids.append(token_id)
        if token_id in request.eos_token_ids or token_id in request.params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            if token_id in request.params.stop_token_ids:
                request.stop_reason = token_id
        elif request.grammar is not None and request.grammar.finished:
            request.status = RequestStatus.FINISHED_STOPPED
        elif len(output_ids) >= request.max_tokens or len(request.prompt_token_ids) + len(output_ids) >= (
            self.config.max_model_len or 0
        ):
            request.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        request.metrics.finished_time = now
        return True

    def _count_lora_request(self, request: Request) -> None:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            self.lora_requests_finished[name] = self.lora_requests_finished.get(name, 0) + 1

    def _lora_stats(self) -> LoRAStats | None:
        if self.lora is None:
            return None
        return LoRAStats(
            max_lora=self.config.max_loras,
            running=_adapter_names(self.scheduler.running),
            waiting=_adapter_names(self.scheduler.waiting),
            requests_finished=dict(self.lora_requests_finished),
        )

    def _kv_offload_stats(self) -> KVOffloadStats | None:
        host = self.kv.host
        if host is None:
            return None
        return KVOffloadStats(
            num_cpu_blocks=host.num_blocks,
            cpu_cache_usage=host.usage(),
            queries=self.kv.tier_queries,
            hits=self.kv.tier_hits,
            store_bytes=host.num_stored * self.block_bytes,
            load_bytes=host.num_loaded * self.block_bytes,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            kv_offload=self._kv_offload_stats(),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_gpu_blocks=self.num_blocks,
            block_size=self.config.block_size,
            spec_decoding=self.spec_stats.snapshot() if self.proposer is not None else None,
            lora=self._lora_stats(),
        )


def _adapter_names(requests: Iterable[Request]) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})

