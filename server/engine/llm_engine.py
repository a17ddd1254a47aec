"""The synchronous engine: validates requests, runs scheduler steps and turns sampled tokens into text.

One ``step()`` schedules a batch, runs one forward pass, appends the sampled tokens, detokenizes them,
applies the stop conditions and frees the blocks of finished requests.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pagedserve.server.backend import select_backend
from pagedserve.server.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from pagedserve.server.core.kv_cache_manager import KVCacheManager
from pagedserve.server.core.scheduler import Scheduler
from pagedserve.server.engine import detokenizer
from pagedserve.server.engine.output import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.server.request import Request, RequestStatus
from pagedserve.server.sampling_params import SamplingParams
from pagedserve.server.worker.model_runner import ModelRunner
from pagedserve.server.worker.sampler import SampledToken

logger = logging.getLogger("pagedserve.engine")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
PromptInput = str | list[int] | dict[str, Any]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_gpu_blocks: int
    block_size: int


@dataclass
class ParentRequest:
    """What the caller asked for: one prompt, ``n`` samples (child Requests)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class StepError(RuntimeError):
    """A forward pass failed; the requests in that batch were aborted, the engine goes on."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} requests: {cause!r}")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.server.loader import load_model, resolve_model
        from transformers import AutoTokenizer

        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        torch.manual_seed(config.seed)
        self.model_path = Path(resolve_model(config.model))
        self.backend = select_backend(self.device, self.dtype, config.attention_backend)
        config.attention_backend = self.backend.name  # what runs, after any fallback: /version shows it
        self.model, self.hf_config = load_model(self.model_path, self.dtype, self.device,
                                                backend=self.backend)
        self.tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer or self.model_path))
        self.eos_token_ids = _eos_token_ids(self.model_path, self.tokenizer)
        self.vocab_size = int(self.hf_config.vocab_size)
        if config.served_model_name is None:
            config.served_model_name = config.model or DEFAULT_SERVED_NAME

        num_kv_heads, head_dim = _kv_shape(self.hf_config)
        num_layers = len(self.model.attention_layers())
        block_bytes = ModelRunner.bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim,
                                                  self.dtype)
        self.num_blocks = self._num_blocks(block_bytes)
        self._resolve_max_model_len()
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                 hash_seed=f"{self.model_path}:{self.dtype}")
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.batched_tokens)
        self.runner = ModelRunner(self.model, self.backend, self.num_blocks, config.block_size, num_kv_heads,
                                  head_dim, self.dtype, self.device, max_num_seqs=config.max_num_seqs,
                                  max_model_len=config.max_model_len or 0, enforce_eager=config.enforce_eager)
        self.parents: dict[str, ParentRequest] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        logger.info("engine ready: model=%s device=%s dtype=%s backend=%s kv_blocks=%d x %d tokens, "
                    "max_model_len=%d", self.model_path, self.device, self.dtype, self.backend.name,
                    self.num_blocks, config.block_size, config.max_model_len)

    # ---- set-up -------------------------------------------------------------------------------------

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

    def _gpu_kv_budget(self) -> int:
        """What is left of ``gpu_memory_utilization`` after the weights and a profiled largest step."""
        from pagedserve.server.worker.cuda_graphs import kv_cache_budget, profile_activation_peak

        peak = profile_activation_peak(self.model, self.config.batched_tokens, self.config.max_num_seqs)
        return kv_cache_budget(self.device, self.config.gpu_memory_utilization, peak)

    def _resolve_max_model_len(self) -> None:
        cfg = self.config
        model_limit = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        capacity = self.num_blocks * cfg.block_size
        if cfg.max_model_len is None:
            cfg.max_model_len = min(model_limit, capacity)
        elif cfg.max_model_len > model_limit:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_limit}")
        elif cfg.max_model_len > capacity:
            raise ValueError(f"max_model_len {cfg.max_model_len} does not fit the KV cache ({capacity} "
                             "tokens); raise kv_cache_memory_bytes or lower max_model_len")

    # ---- requests -----------------------------------------------------------------------------------

    def process_inputs(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                       arrival_time: float | None = None) -> ParentRequest:
        """Tokenize and validate; touches no engine state, so it may run on any thread."""
        text, token_ids = self._tokenize(prompt)
        max_len = self.config.max_model_len
        assert max_len is not None
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size})")
        if len(token_ids) >= max_len:
            raise ValueError(f"The prompt is {len(token_ids)} tokens, but max_model_len is {max_len}: "
                             "it must be shorter to leave room for at least one generated token")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(token_ids)
        if len(token_ids) + max_tokens > max_len:
            raise ValueError(f"This model's maximum context length (max_model_len) is {max_len} tokens. "
                             f"However, you requested {len(token_ids) + max_tokens} tokens "
                             f"({len(token_ids)} in the prompt, {max_tokens} in max_tokens)")
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            if any(int(t) < 0 or int(t) >= self.vocab_size for t in ids):
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size})")
        arrival = arrival_time if arrival_time is not None else time.time()
        parent = ParentRequest(request_id, text, token_ids)
        for index in range(params.n):
            parent.children.append(self._child(parent, index, params, max_tokens, arrival))
        return parent

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._tokenize(str(prompt["prompt"]))
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, [int(t) for t in prompt]

    def _child(self, parent: ParentRequest, index: int, params: SamplingParams, max_tokens: int,
               arrival: float) -> Request:
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed + index)
        request = Request(
            request_id=f"{parent.request_id}#{index}" if params.n > 1 else parent.request_id,
            parent_id=parent.request_id, index=index, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, params=params, max_tokens=max_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            metrics=RequestMetrics(arrival_time=arrival), generator=generator,
            logprobs=[] if params.logprobs is not None else None,
        )
        detokenizer.init_offsets(request)
        return request

    def add(self, parent: ParentRequest) -> None:
        if parent.request_id in self.parents:
            raise ValueError(f"request_id {parent.request_id!r} is already in use")
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.scheduler.add(child)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        self.add(self.process_inputs(request_id, prompt, params, arrival_time))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        for child in parent.children:
            if not child.finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                child.metrics.finished_time = time.time()
        return self._output(parent)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        block_ids = {s.request.request_id: self.kv.block_ids(s.request.request_id) for s in plan.scheduled}
        try:
            sampled = self.runner.execute(plan.scheduled, block_ids)
        except Exception as exc:
            raise self._fail_step([s.request for s in plan.scheduled], exc) from exc
        for item in plan.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        now = time.time()
        touched: dict[str, ParentRequest] = {}
        for request, token in sampled:
            self._append_token(request, token, now)
            if request.finished:
                self.scheduler.finish(request, request.status)
            touched[request.parent_id] = self.parents[request.parent_id]
        outputs = [self._output(p) for p in touched.values()]
        for parent in touched.values():
            if parent.finished:
                del self.parents[parent.request_id]
        return outputs

    def _fail_step(self, requests: list[Request], exc: BaseException) -> StepError:
        logger.exception("engine step failed; aborting %d requests", len(requests))
        parent_ids = sorted({r.parent_id for r in requests})
        for parent_id in parent_ids:
            self.abort_request(parent_id)
        # Blocks registered for this step may hold half-written K/V: forget every cached prefix.
        self.kv.pool.reset_prefix_cache()
        return StepError(parent_ids, exc)

    def _append_token(self, request: Request, token: SampledToken, now: float) -> None:
        if request.num_output_tokens == 0:
            request.metrics.first_token_time = now
            self.prompt_tokens += request.num_prompt_tokens
        request.metrics.last_token_time = now
        self.generation_tokens += 1
        token_id = token.token_id
        request.output_token_ids.append(token_id)
        if request.logprobs is not None:
            self._record_logprobs(request, token)
        stopped_by_token = token_id in request.eos_token_ids or token_id in request.params.stop_token_ids
        if not stopped_by_token or request.params.include_stop_str_in_output:
            new_text = detokenizer.decode_new_text(self.tokenizer, request, request.num_tokens)
            request.output_text += new_text
            stop_string = detokenizer.find_stop_string(request, len(new_text))
            if stop_string is not None:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_string
        if stopped_by_token and not request.finished:
            request.status = RequestStatus.FINISHED_STOPPED
            if token_id in request.params.stop_token_ids:
                request.stop_reason = token_id
        if not request.finished and (request.num_output_tokens >= request.max_tokens
                                     or request.num_tokens >= (self.config.max_model_len or 0)):
            request.status = RequestStatus.FINISHED_LENGTH
        if request.finished:
            request.metrics.finished_time = now

    def _record_logprobs(self, request: Request, token: SampledToken) -> None:
        assert request.logprobs is not None and token.logprob is not None
        decode = self.tokenizer.decode
        entry = {token.token_id: Logprob(token.logprob, token.rank, decode([token.token_id]))}
        alternatives = zip(token.top_ids or [], token.top_logprobs or [], strict=True)
        for rank, (tid, lp) in enumerate(alternatives, start=1):
            entry.setdefault(tid, Logprob(lp, rank, decode([tid])))
        request.logprobs.append(entry)
        request.cumulative_logprob += token.logprob

    def _output(self, parent: ParentRequest) -> RequestOutput:
        completions = [_completion(c) for c in parent.children]
        first = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            outputs=completions, finished=parent.finished, metrics=first.metrics,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(), prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            num_gpu_blocks=self.num_blocks, block_size=self.config.block_size,
        )


def _completion(request: Request) -> CompletionOutput:
    text = request.output_text
    held_back = request.params.stop_buffer_length
    if held_back and not request.finished:
        text = text[:max(len(text) - held_back, 0)]
    return CompletionOutput(
        index=request.index, text=text, token_ids=list(request.output_token_ids),
        cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
        logprobs=list(request.logprobs) if request.logprobs is not None else None,
        finish_reason=request.finish_reason, stop_reason=request.stop_reason,
    )


def _kv_shape(hf_config: Any) -> tuple[int, int]:
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    return num_kv_heads, head_dim


def _eos_token_ids(model_path: Path, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = model_path / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)
