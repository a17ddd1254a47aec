"""Turns one step's logits into next tokens, vectorised over the batch.

Order, as in vLLM V1 (vllm/v1/sample/sampler.py, after the model runner's grammar bitmask): first the
structured-output bitmask (server/structured_output/bitmask.py), so a grammar's refused tokens are gone
even from the logprobs; logprobs come from those logits; then allowed_token_ids, bad_words, min_tokens
masking (which never leaves a row nothing: a grammar that can only end keeps its EOS), logit bias and
the presence / frequency / repetition penalties; greedy rows take the argmax, the others are scaled by
temperature, filtered by min-p, then top-k and top-p, and sampled with per-request generators.

Every tensor made here lives on ``logits.device`` and nothing reads a tensor back to the host before
``SamplerOutput.to_host``: on a GPU a host tensor in an op raises, and a read-back stalls the step
(tests/engine/test_sampler.py runs every path on the ``meta`` device to prove both).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from pagedserve.server.outputs import SampledToken
from pagedserve.server.request import Request
from pagedserve.server.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask

logger = logging.getLogger("pagedserve.engine")


@dataclass
class LogprobTensors:
    """The raw logprobs a step's requests asked for, one row per request, still on the device."""

    chosen: torch.Tensor  # [batch] logprob of the sampled token
    ranks: torch.Tensor  # [batch] its rank, 1 = most likely
    top_ids: torch.Tensor | None  # [batch, max k] or None when every k is 0
    top_values: torch.Tensor | None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [batch] long
    logprobs: LogprobTensors | None  # None when no request asked for logprobs
    # Set by ``copy_to_host``: passed once the copies to the host are done
    copied: torch.cuda.Event | None = None

    def copy_to_host(self) -> SamplerOutput:
        """These tensors copied to pinned host memory without waiting for them (on a GPU; elsewhere the
        same object): ``to_host`` then waits for the copies alone, not for the work queued after them, such
        as the next step's forward pass under async scheduling (server/engine/core.py)."""
        if self.token_ids.device.type != "cuda":
            return self
        lp = self.logprobs
        token_ids = _pinned_copy(self.token_ids)
        host_logprobs = None if lp is None else LogprobTensors(
            *(_pinned_copy(t) for t in (lp.chosen, lp.ranks, lp.top_ids, lp.top_values))  # type: ignore[arg-type]
        )
        copied = torch.cuda.Event()
        copied.record()  # after every copy above: passing it means they are all done
        return SamplerOutput(token_ids, host_logprobs, copied)

    def to_host(self, requests: list[Request]) -> list[SampledToken]:
        """The one read-back of the step: each request's token and the logprobs it asked for."""
        if self.copied is not None:
            self.copied.synchronize()
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return [SampledToken(t) for t in token_ids]
        chosen, ranks = self.logprobs.chosen.tolist(), self.logprobs.ranks.tolist()
        top_ids = self.logprobs.top_ids.tolist() if self.logprobs.top_ids is not None else None
        top_values = self.logprobs.top_values.tolist() if self.logprobs.top_values is not None else None
        results = []
        for row, (token_id, request) in enumerate(zip(token_ids, requests, strict=True)):
            k = request.params.logprobs
            if k is None:
                results.append(SampledToken(token_id))
                continue
            results.append(SampledToken(
                token_id=token_id,
                logprob=chosen[row],
                rank=ranks[row],
                top_ids=top_ids[row][:k] if k and top_ids else [],
                top_logprobs=top_values[row][:k] if k and top_values else [],
            ))
        return results


def _pinned_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


@dataclass
class LaunchedSample:
    """A batch's sampling, launched: its tokens on the device (the next step's inputs under async
    scheduling) and on their way to the host; or, where the batch had to be sampled row by row, each
    row's result already on the host."""

    device_token_ids: torch.Tensor | None
    host: SamplerOutput | None
    rows: list[SampledToken | Exception] | None = None

    def result(self, requests: list[Request]) -> list[SampledToken | Exception]:
        if self.rows is not None:
            return self.rows
        assert self.host is not None
        return list(self.host.to_host(requests))


def sample(logits: torch.Tensor, requests: list[Request],
           grammar: GrammarBitmask | None = None) -> list[SampledToken]:
    """``logits`` ``[len(requests), vocab]``, one row per request that needs a new token; ``grammar``: the
    bitmask of the rows with a grammar, on ``logits.device``."""
    return sample_on_device(logits, requests, grammar).to_host(requests)


def sample_each(logits: torch.Tensor, requests: list[Request],
                grammar: GrammarBitmask | None = None) -> list[SampledToken | Exception]:
    """``sample``, but a row that cannot be sampled fails its own request, never the batch.

    Requests are checked before they run (server/engine/processor.py), yet a row can still fail in ways
    no check foresees (a bug on a path only some parameters take, memory for a large penalty). Then
    each row is sampled alone: a failing row gets its exception, the others their tokens. Seeded
    generators are rewound first, so a retried row draws exactly what it would have drawn.
    """
    return launch_sample(logits, requests, grammar).result(requests)


def launch_sample(logits: torch.Tensor, requests: list[Request],
                  grammar: GrammarBitmask | None = None) -> LaunchedSample:
    """``sample_each`` without waiting for the tokens: they are read back by ``LaunchedSample.result``."""
    states = [r.generator.get_state() if r.generator is not None else None for r in requests]
    try:
        output = sample_on_device(logits, requests, grammar)
        return LaunchedSample(output.token_ids, output.copy_to_host())
    except Exception:
        logger.exception("sampling a batch of %d failed; sampling each request alone", len(requests))
    return LaunchedSample(None, None, _sample_rows(logits, requests, grammar, states))


def _sample_rows(logits: torch.Tensor, requests: list[Request], grammar: GrammarBitmask | None,
                 states: list[torch.Tensor | None]) -> list[SampledToken | Exception]:
    results: list[SampledToken | Exception] = []
    for row, (request, state) in enumerate(zip(requests, states, strict=True)):
        if request.generator is not None and state is not None:
            request.generator.set_state(state)
        try:
            results.extend(sample(logits[row:row + 1], [request], grammar and grammar.select(row)))
        except Exception as exc:  # this request's row: it fails alone
            logger.exception("sampling request %s failed", request.request_id)
            results.append(exc)
    return results


def sample_on_device(logits: torch.Tensor, requests: list[Request],
                     grammar: GrammarBitmask | None = None) -> SamplerOutput:
    if grammar is None and all(r.params.argmax_only and not r.bad_words_token_ids for r in requests):
        # The common greedy batch: every step below would leave the logits as they are.
        return SamplerOutput(logits.argmax(dim=-1), None)
    logits, raw_logprobs = process_logits(logits, requests, grammar)
    return sampler_output(_choose(logits, requests), raw_logprobs, requests)


def process_logits(logits: torch.Tensor, requests: list[Request],
                   grammar: GrammarBitmask | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Everything before the choice of a token: the masks, the bias and the penalties; and the raw logprobs
    (None when no request asked for them). The rejection sampler (server/spec_decode/rejection_sampler.py)
    verifies drafts against exactly these."""
    logits = apply_grammar_bitmask(logits.float(), grammar)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if _any_logprobs(requests) else None
    logits = _apply_allowed_token_ids(logits, requests)
    logits = _mask(logits, _bad_word_bans(requests))
    logits = _apply_min_tokens(logits, requests)
    logits = _apply_logit_bias(logits, requests)
    logits = _apply_penalties(logits, requests)
    return logits, raw_logprobs


def sampler_output(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None,
                   requests: list[Request]) -> SamplerOutput:
    logprobs = _logprob_tensors(raw_logprobs, token_ids, requests) if raw_logprobs is not None else None
    return SamplerOutput(token_ids, logprobs)


def _any_logprobs(requests: list[Request]) -> bool:
    return any(r.params.logprobs is not None for r in requests)


def _cells(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(cols, dtype=torch.long, device=device))


def _mask(logits: torch.Tensor, cells: tuple[list[int], list[int]]) -> torch.Tensor:
    """``-inf`` at each (row, token) of ``cells``: those tokens cannot be sampled this step."""
    rows, cols = cells
    if not rows:
        return logits
    return logits.index_put(_cells(rows, cols, logits.device),
                            torch.tensor(float("-inf"), device=logits.device))


def _apply_allowed_token_ids(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    restricted = [row for row, r in enumerate(requests) if r.params.allowed_token_ids]
    if not restricted:
        return logits
    device = logits.device
    allowed = torch.ones_like(logits, dtype=torch.bool)
    allowed[torch.tensor(restricted, dtype=torch.long, device=device)] = False
    rows = [row for row in restricted for _ in requests[row].params.allowed_token_ids or []]
    cols = [t for row in restricted for t in requests[row].params.allowed_token_ids or []]
    allowed = allowed.index_put(_cells(rows, cols, device), torch.tensor(True, device=device))
    return logits.masked_fill(~allowed, float("-inf"))


def _bad_word_bans(requests: list[Request]) -> tuple[list[int], list[int]]:
    """vLLM's rule: a bad word's last token is banned when the generated tokens end with the rest of it."""
    rows, cols = [], []
    for row, request in enumerate(requests):
        output = request.output_token_ids
        for word in request.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                rows.append(row)
                cols.append(word[-1])
    return rows, cols


def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Stop tokens banned before min_tokens, except in a row where nothing else was left (a grammar that
    admits only EOS ends, min_tokens or not)."""
    banned = _mask(logits, _stop_tokens_before_min(requests))
    if banned is logits:
        return logits
    emptied = (banned == float("-inf")).all(dim=-1, keepdim=True)
    return torch.where(emptied, logits, banned)


def _stop_tokens_before_min(requests: list[Request]) -> tuple[list[int], list[int]]:
    rows, cols = [], []
    for row, request in enumerate(requests):
        if request.num_output_tokens < request.params.min_tokens:
            stop_ids = set(request.params.stop_token_ids or []) | set(request.eos_token_ids)
            rows.extend([row] * len(stop_ids))
            cols.extend(stop_ids)
    return rows, cols


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    rows, cols, values = [], [], []
    for row, request in enumerate(requests):
        for token_id, bias in (request.params.logit_bias or {}).items():
            rows.append(row)
            cols.append(int(token_id))
            values.append(float(bias))
    if not rows:
        return logits
    bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits.index_put(_cells(rows, cols, logits.device), bias, accumulate=True)


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    penalised = [
        row for row, r in enumerate(requests)
        if r.params.presence_penalty or r.params.frequency_penalty or r.params.repetition_penalty != 1.0
    ]
    if not penalised:
        return logits
    device = logits.device
    chosen = [requests[row] for row in penalised]
    index = torch.tensor(penalised, dtype=torch.long, device=device)
    values = logits.index_select(0, index)
    output_counts = _token_counts([r.output_token_ids for r in chosen], values)
    generated = output_counts > 0
    seen = generated | (_token_counts([r.prompt_token_ids for r in chosen], values) > 0)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in chosen], dtype=values.dtype,
                            device=device).unsqueeze(1)

    repetition = column("repetition_penalty")
    scaled = torch.where(values > 0, values / repetition, values * repetition)
    values = torch.where(seen, scaled, values)
    values = values - column("frequency_penalty") * output_counts
    values = values - column("presence_penalty") * generated.to(values.dtype)
    return logits.index_copy(0, index, values)


def _token_counts(token_lists: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """``[len(token_lists), vocab]``: how often each token occurs in each list."""
    rows = [row for row, tokens in enumerate(token_lists) for _ in tokens]
    cols = [t for tokens in token_lists for t in tokens]
    counts = torch.zeros_like(like)
    if not rows:
        return counts
    ones = torch.ones(len(rows), dtype=like.dtype, device=like.device)
    return counts.index_put(_cells(rows, cols, like.device), ones, accumulate=True)


def _choose(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    chosen = logits.argmax(dim=-1)
    random_rows = [row for row, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        probs = filtered_probs(logits.index_select(0, index), [requests[r] for r in random_rows])
        picks = exponential_race(probs, [requests[r].generator for r in random_rows])
        chosen = chosen.index_copy(0, index, picks)
    return chosen


def filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, then min-p, then top-k and top-p (vLLM's order), as probabilities."""
    device = logits.device

    def column(values: list[float] | list[int]) -> torch.Tensor:
        return torch.tensor(values, device=device)

    # A temperature past float32's range would be inf there, and a masked logit (-inf) over it NaN: the
    # largest finite one keeps masked tokens at -inf and spreads the others evenly, as that temperature does.
    temperatures = column([r.params.temperature for r in requests]).clamp(max=torch.finfo(torch.float32).max)
    logits = logits / temperatures.unsqueeze(1)
    if any(r.params.min_p > 0 for r in requests):
        logits = _apply_min_p(logits, column([r.params.min_p for r in requests]))
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in requests):
        top_k = column([r.params.top_k for r in requests])
        logits = _top_k_top_p(logits, top_k, column([r.params.top_p for r in requests]))
    return torch.softmax(logits, dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop the tokens less likely than ``min_p`` times the most likely one."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) samples from p; seeded rows draw E from their own generator."""
    noise = torch.empty_like(probs)
    unseeded = [row for row, g in enumerate(generators) if g is None]
    if unseeded:
        index = torch.tensor(unseeded, dtype=torch.long, device=probs.device)
        draws = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        noise = noise.index_copy(0, index, draws)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _logprob_tensors(raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                     requests: list[Request]) -> LogprobTensors:
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    max_k = max(r.params.logprobs or 0 for r in requests)
    top_values, top_ids = raw_logprobs.topk(max_k, dim=-1) if max_k else (None, None)
    return LogprobTensors(chosen.squeeze(1), ranks, top_ids, top_values)
