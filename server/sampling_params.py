"""Per-request sampling parameters with vLLM's field names, defaults and validation, and the shape of
output the caller wants (``RequestOutputKind``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedserve.server.exceptions import InvalidRequestError

SAMPLING_EPS = 1e-5  # below this temperature sampling is greedy, as in vLLM
MAX_LOGPROBS = 20  # top-k bound of logprobs and prompt_logprobs: vLLM's default --max-logprobs


@dataclass(frozen=True)
class ThinkGate:
    """A reasoning model's think tags as token ids: a grammar waits for the reasoning to end and then
    constrains the answer (vLLM applies structured outputs after the reasoning the same way). Set by the
    API from --reasoning-parser (server/api/reasoning_parsers/), followed by server/grammar_state.py."""

    start_token_id: int  # the tag that opens the reasoning, when the reply writes it first
    end_token_id: int  # the tag that closes it: the grammar constrains every token after it
    thinks_from_start: bool  # the prompt opened the reasoning: the reply is in it from its first token


@dataclass
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: constrain a request's output to one grammar. Exactly one of the
    constraint fields is set (``json_object`` counts when True); the engine compiles it (once per distinct
    constraint) and masks every sampled token with it."""

    json: str | dict | None = None  # a JSON schema, as text or as a parsed object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF / Lark text
    json_object: bool | None = None  # any JSON object (response_format {"type": "json_object"})
    structural_tag: str | None = None  # vLLM's structural tag, as JSON text
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    whitespace_pattern: str | None = None
    think_gate: ThinkGate | None = None  # a reasoning model's: the grammar applies after its reasoning

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs must set exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)}; got {', '.join(given) or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of strings",
                                      param="structured_outputs.choice")

    @property
    def kind(self) -> str:
        """The one constraint field that is set."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))


CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class RequestOutputKind(enum.Enum):
    """vLLM's names for what each RequestOutput of a request holds (server/engine/output_processor.py)."""

    CUMULATIVE = 0  # everything generated so far, every step
    DELTA = 1  # only what is new since the last output: the server streams these
    FINAL_ONLY = 2  # one output when the request has finished: the offline LLM asks for this


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt token (the first has none)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only matters when special tokens are shown
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated; the Processor tokenizes them for the core
    structured_outputs: StructuredOutputsParams | None = None  # output constrained to a grammar
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Prefill/decode disaggregation's (vLLM's extra_args["kv_transfer_params"]): the request's role in a
    # P/D pair, as the API received it; server/kv_transfer_params.py parses it, in the input processor
    kv_transfer_params: dict[str, Any] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", f"must be at least 1, got {self.n}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than zero"),
            (self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k", f"must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must be less than or equal to max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"must be in [0, {MAX_LOGPROBS}]"),
            (all(s for s in self.stop_strings), "stop", "must not contain empty strings"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
             "must not be empty"),
            (all(w.strip() for w in self.bad_words or []), "bad_words", "must not contain blank strings"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {message}", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def argmax_only(self) -> bool:
        """Greedy, with nothing that changes the logits first and no logprobs: a batch of only such rows
        is sampled by one argmax (server/sample/sampler.py ``sample_on_device``)."""
        return (
            self.temperature < SAMPLING_EPS
            and self.logprobs is None
            and not self.logit_bias
            and not self.allowed_token_ids
            and not self.reads_own_output
        )

    @property
    def reads_own_output(self) -> bool:
        """The logits it samples from depend on the tokens it generated (penalties, bad words, min_tokens),
        so async scheduling cannot run its next step before its last token is known
        (server/core/scheduler.py)."""
        return bool(
            self.min_tokens
            or self.bad_words
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def stop_buffer_length(self) -> int:
        """Characters held back from streamed text so a stop string is never half-emitted."""
        if not self.stop_strings or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop_strings) - 1
