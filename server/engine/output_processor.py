"""The front end's half of every step: core token ids in, RequestOutputs out (vLLM's OutputProcessor).

Per request it owns what needs the tokenizer or the caller's view: incremental detokenization
(server/engine/detokenizer.py), stop strings, logprob strings (``Logprob.decoded_token``) of the
output and of the prompt (``prompt_logprobs``), the cumulative logprob, gathering the n samples of
one request (each is its own core request) and the shape of each output (``RequestOutputKind``).
The async engine runs it on the event loop, the sync engine right after each step; either way the
step thread never calls the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.server.engine.core_output import EngineCoreOutput
from pagedserve.server.engine.detokenizer import IncrementalDetokenizer, stream_tokenizer, text_decoder
from pagedserve.server.engine.processor import ProcessedRequest
from pagedserve.server.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.server.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedserve.server.outputs import SampledToken


@dataclass
class SampleState:
    """One of a request's n samples, as the caller will see it."""

    index: int
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # How far DELTA outputs have gone: characters of text, tokens (and their logprobs).
    sent_chars: int = 0
    sent_tokens: int = 0
    last_token_time: float | None = None  # the core's time of this sample's last step with tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, SampleState]  # by core request id
    num_cached_tokens: int = 0
    changed: set[int] = field(default_factory=set)  # sample indexes with news since the last output
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False  # DELTA outputs carry them once
    inter_token_latencies: list[float] = field(default_factory=list)  # not yet in an output
    pooled: list[float] | None = None  # a pooling request's vector
    kv_transfer_params: dict | None = None  # a finished prefill's (server/core/mooncake_connector.py)

    @property
    def finished(self) -> bool:
        # A list, not all() over a generator: asked of every request each step, mostly with one sample
        return None not in [sample.finish_reason for sample in self.samples.values()]


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Core requests that a stop string finished: abort them in the core so their blocks return.
    to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer)
        self._stream_backend = stream_tokenizer(tokenizer)  # None: the sequences decode by windows
        self.requests: dict[str, RequestState] = {}
        self.parent_of: dict[str, str] = {}  # core request id -> the caller's request id
        self._token_text: dict[int, str] = {}  # decode([token_id]) for logprobs, cached
        # Added (special) tokens by id, for spaces_between_special_tokens=False.
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added_tokens: dict[int, str] = {i: t.content for i, t in decoder.items()}

    def add_request(self, request: ProcessedRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params = request.params
        samples = {}
        for index, child in enumerate(request.children):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.skip_special_tokens,
                params.stop_strings,
                params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
                added_tokens=None if params.spaces_between_special_tokens else self._added_tokens,
                decode=self._decode,
                stream_backend=self._stream_backend,
            )
            samples[child.request_id] = SampleState(
                index, detokenizer, child.metrics, [] if params.logprobs is not None else None
            )
            self.parent_of[child.request_id] = request.request_id
        self.requests[request.request_id] = RequestState(
            request.request_id, request.prompt, request.prompt_token_ids, params, samples
        )

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its core request ids (the caller aborts those in the core)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for core_id in state.samples:
            self.parent_of.pop(core_id, None)
        return list(state.samples)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def requests_of(self, core_ids: list[str]) -> list[str]:
        """The callers' requests these core requests belong to (those still known), in order: when a
        sample fails, its whole request fails (both engines' one failure path)."""
        parents = self.parent_of
        return sorted({parents[i] for i in core_ids if i in parents})

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for core_output in core_outputs:
            parent_id = self.parent_of.get(core_output.request_id)
            if parent_id is None:
                continue  # aborted, or stopped by a stop string, since the core ran this step
            state = self.requests[parent_id]
            sample = state.samples[core_output.request_id]
            if sample.finished:
                continue  # a stop string ended it; the core ran it once more before the abort arrived
            # The core's timestamps: the same object in-process, a fresh copy from a core process
            sample.metrics = core_output.metrics
            if sample.index == 0:
                state.num_cached_tokens = core_output.num_cached_tokens
            if core_output.prompt_logprobs is not None:
                state.prompt_logprobs = [None, *map(self._logprob_entry, core_output.prompt_logprobs)]
            if core_output.pooled is not None:
                state.pooled = core_output.pooled
            if core_output.kv_transfer_params is not None:
                state.kv_transfer_params = core_output.kv_transfer_params
            self._time_tokens(state, sample, core_output)
            if self._update(sample, core_output, state.params) and core_output.finish_reason is None:
                to_abort.append(core_output.request_id)
            state.changed.add(sample.index)
            touched[parent_id] = state
        outputs = []
        for state in touched.values():
            output = self._make_output(state)
            if output is not None:
                outputs.append(output)
            if state.finished:
                self.abort_request(state.request_id)
        return ProcessedOutputs(outputs, to_abort)

    # ---- one sample ---------------------------------------------------------------------------------

    @staticmethod
    def _time_tokens(state: RequestState, sample: SampleState, core_output: EngineCoreOutput) -> None:
        """The gap since the sample's last step with tokens, by the core's clock (vLLM's inter-token
        latency: one per step, however many tokens the step gave)."""
        now = core_output.token_time
        if not core_output.new_token_ids or now is None:
            return
        if sample.last_token_time is not None:
            state.inter_token_latencies.append(now - sample.last_token_time)
        sample.last_token_time = now

    def _update(self, sample: SampleState, core_output: EngineCoreOutput, params: SamplingParams) -> bool:
        """Apply the step's tokens to one sample; True when a stop string finished it."""
        finish, stop_reason = core_output.finish_reason, core_output.stop_reason
        stopped_by_token = finish == "stop"
        for i, token_id in enumerate(core_output.new_token_ids):
            if core_output.new_logprobs is not None:
                self._record_logprobs(sample, core_output.new_logprobs[i])
            last = i == len(core_output.new_token_ids) - 1
            decode = not (last and stopped_by_token) or params.include_stop_str_in_output
            stop_string = sample.detokenizer.add_token(token_id, decode)
            if stop_string is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop_string
                if core_output.finish_reason is None:
                    sample.metrics.finished_time = core_output.metrics.last_token_time
                return True
        sample.finish_reason, sample.stop_reason = finish, stop_reason
        return False

    def _record_logprobs(self, sample: SampleState, token: SampledToken) -> None:
        assert sample.logprobs is not None and token.logprob is not None
        sample.logprobs.append(self._logprob_entry(token))
        sample.cumulative_logprob += token.logprob

    def _logprob_entry(self, token: SampledToken) -> dict[int, Logprob]:
        """One position's logprobs: its token's, then the top-k alternatives, each with its text."""
        assert token.logprob is not None
        text = self._decode_one
        entry = {token.token_id: Logprob(token.logprob, token.rank, text(token.token_id))}
        alternatives = zip(token.top_ids or [], token.top_logprobs or [], strict=True)
        for rank, (token_id, logprob) in enumerate(alternatives, start=1):
            if token_id not in entry:
                entry[token_id] = Logprob(logprob, rank, text(token_id))
        return entry

    def _decode_one(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._decode([token_id], False)
        return text

    # ---- outputs ------------------------------------------------------------------------------------

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        if state.params.prompt_logprobs is not None and state.prompt_logprobs is None and not state.finished:
            return None  # another sample ran ahead of the first: no output before the prompt logprobs
        samples = sorted(state.samples.values(), key=lambda s: s.index)
        if kind is not RequestOutputKind.DELTA:  # FINAL_ONLY (finished, above) or CUMULATIVE
            completions = [self._cumulative(s, state.params) for s in samples]
        else:
            completions = [
                c
                for s in samples
                if s.index in state.changed
                if (c := self._delta(s, state.params)) is not None
            ]
            if not completions and not state.finished:
                return None
        state.changed.clear()
        prompt_logprobs = state.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            if state.sent_prompt_logprobs:
                prompt_logprobs = None
            state.sent_prompt_logprobs |= prompt_logprobs is not None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            num_cached_tokens=state.num_cached_tokens,
            outputs=completions,
            finished=state.finished,
            metrics=samples[0].metrics,
            prompt_logprobs=prompt_logprobs,
            inter_token_latencies=self._take_latencies(state),
            pooled=state.pooled,
            kv_transfer_params=state.kv_transfer_params,
        )

    @staticmethod
    def _take_latencies(state: RequestState) -> list[float]:
        latencies, state.inter_token_latencies = state.inter_token_latencies, []
        return latencies

    @staticmethod
    def _visible_chars(sample: SampleState, params: SamplingParams) -> int:
        """Characters of text that may be shown: a possible stop-string start is held back until decided."""
        length = len(sample.detokenizer.text)
        if sample.finished:
            return length
        return max(length - params.stop_buffer_length, 0)

    def _cumulative(self, sample: SampleState, params: SamplingParams) -> CompletionOutput:
        detokenizer = sample.detokenizer
        return CompletionOutput(
            index=sample.index,
            text=detokenizer.text[: self._visible_chars(sample, params)],
            token_ids=list(detokenizer.output_token_ids),
            cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
            logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _delta(self, sample: SampleState, params: SamplingParams) -> CompletionOutput | None:
        """What is new since this sample's last delta; None while nothing new can be shown.

        Tokens whose text is still held back (a stop-string prefix, half a UTF-8 character) wait for
        the delta that shows their text, so every delta a client sees carries text or a finish.
        """
        visible = self._visible_chars(sample, params)
        if visible == sample.sent_chars and not sample.finished:
            return None
        detokenizer = sample.detokenizer
        num_tokens = len(detokenizer.output_token_ids)
        delta = CompletionOutput(
            index=sample.index,
            text=detokenizer.text[sample.sent_chars : visible],
            token_ids=detokenizer.output_token_ids[sample.sent_tokens : num_tokens],
            cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
            logprobs=sample.logprobs[sample.sent_tokens : num_tokens]
            if sample.logprobs is not None
            else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )
        sample.sent_chars, sample.sent_tokens = visible, num_tokens
        return delta
