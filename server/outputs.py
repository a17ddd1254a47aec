"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes.

Whether an output holds everything so far, only what is new, or arrives once at the end is the
request's ``SamplingParams.output_kind`` (server/sampling_params.py); ``RequestOutput.add`` folds
delta outputs back into a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class SampledToken:
    """One token the sampler picked (or a prompt token scored), with the logprobs asked for: the engine
    core's record, before the front end decodes it into ``Logprob``s."""

    token_id: int
    logprob: float | None = None  # raw log-probability of the sampled token
    rank: int | None = None  # 1 = most likely
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # always the running total, also in delta outputs
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # vLLM's prompt_logprobs: None for the first prompt token, then each token's logprob and top-k.
    # A DELTA output carries them once, in the first output after they are known.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The gaps between the core's steps that gave this request tokens, since its last output (the core's
    # timestamps, so vllm:inter_token_latency_seconds does not depend on how late the API reads them)
    inter_token_latencies: list[float] = field(default_factory=list)
    # A pooling request's vector (server/worker/pooler.py): its one output, with ``finished``
    pooled: list[float] | None = None
    # Prefill/decode disaggregation: where a finished prefill's KV waits for its decode engine (vLLM's
    # RequestOutput.kv_transfer_params; server/kv_transfer_params.py)
    kv_transfer_params: dict | None = None

    def add(self, delta: RequestOutput) -> None:
        """Append a later delta output of the same request to this one (text, tokens and logprobs)."""
        by_index = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:
                old = by_index[new.index] = CompletionOutput(new.index, "", [], None, None)
                self.outputs.append(old)
                self.outputs.sort(key=lambda c: c.index)
            old.text += new.text
            old.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.pooled is not None:
            self.pooled = delta.pooled
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params
        self.num_cached_tokens = delta.num_cached_tokens
        self.finished = delta.finished
        self.metrics = delta.metrics
        self.inter_token_latencies.extend(delta.inter_token_latencies)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[T]):
    """vLLM's output of ``LLM.embed`` (``EmbeddingOutput``) and ``LLM.score`` (``ScoringOutput``)."""

    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]
