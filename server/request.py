"""One sequence as the engine core sees it: token ids, progress through the scheduler, status.

Text, stop strings and logprob strings are the front end's (server/engine/output_processor.py); a
prompt asked with n > 1 becomes n of these, each its own core request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    from pagedserve.server.grammar_state import GrammarState
    from pagedserve.server.kv_transfer_params import KVTransfer
    from pagedserve.server.multimodal import ImageInput
    from pagedserve.server.outputs import SampledToken


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


# A tuple, not a set: membership by identity, where a set would call Enum's __hash__, written in Python,
# several times per request per step (server/engine/core_output.py, the scheduler's stops)
FINISHED_STATUSES = (
    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED
)


@dataclass(eq=False)
class Request:
    """One sequence; ``seed`` is already offset by the sample's index, so n samples differ."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len by server/engine/processor.py
    eos_token_ids: frozenset[int]
    metrics: RequestMetrics
    seed: int | None = None
    # params.bad_words as token sequences (server/engine/processor.py tokenizes them)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    cache_salt: str | None = None  # enters the first block's hash: only the same salt shares KV blocks
    # The adapter it runs with (server/lora/), None: the base model; its name enters the first block's hash
    lora_request: LoRARequest | None = None
    # Logprobs of prompt tokens 1.. as the runner computes them (None: not asked for). Only the first of
    # n samples asks; computing them needs every prompt position, so this request skips prefix-cache hits.
    prompt_logprobs: list[SampledToken] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first scheduling
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None  # the stop_token_id that finished it
    generator: torch.Generator | None = None  # made by the core, on its device
    # params.structured_outputs' matcher, this sample's own (server/grammar_state.py)
    grammar: GrammarState | None = None
    # Speculative decoding (server/spec_decode/): the drafts proposed for the next step, verified there and
    # never part of the sequence until accepted; the EWMA of their acceptance and the pause it may cause.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_acceptance: float = 1.0
    spec_cooldown: int = 0
    # A pooling request (server/pooling_params.py): its prompt runs, then one vector is its output instead
    # of a sampled token (server/worker/pooler.py makes it; it finishes the request).
    pooling: PoolingParams | None = None
    pooling_sum: torch.Tensor | None = None  # MEAN: the sum of the prompt's hidden states computed so far
    pooled: list[float] | None = None
    # The prompt's images (server/multimodal.py), and their encoder features once the runner made them
    # (by index; held here so the runner's cache of them empties as the requests finish)
    mm_inputs: list[ImageInput] = field(default_factory=list)
    mm_features: dict[int, torch.Tensor] = field(default_factory=dict)
    # Multimodal RoPE (Qwen2-VL): every prompt position's [3, num_prompt] rotary positions, and the offset
    # of the positions after the prompt (server/multimodal.py mrope_positions); None: positions are indices
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    # Prefill/decode disaggregation (server/core/mooncake_connector.py): this request's role in a P/D pair,
    # from its kv_transfer_params (cleared once a decode request's read is planned), and the params a
    # finished prefill hands its decode engine
    kv_transfer: KVTransfer | None = None
    kv_transfer_params: dict | None = None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (vLLM's convention)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """Every prompt position must run: prompt logprobs still owed, or a pooling over every position."""
        return self.needs_prompt_logprobs or (self.pooling is not None and self.pooling.reads_every_position)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still owed (one per prompt token after the first)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status in FINISHED_STATUSES else None


def token_slice(prompt_token_ids: list[int], output_token_ids: list[int], start: int, end: int) -> list[int]:
    """Tokens ``[start, end)`` of prompt + output without concatenating the whole sequence (hot path)."""
    num_prompt = len(prompt_token_ids)
    if end <= num_prompt:
        return prompt_token_ids[start:end]
    if start >= num_prompt:
        return output_token_ids[start - num_prompt:end - num_prompt]
    return prompt_token_ids[start:] + output_token_ids[:end - num_prompt]
