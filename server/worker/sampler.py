"""Turns one step's logits into next tokens, vectorised over the batch.

Order, as in vLLM: logprobs come from the raw logits; then logit bias, min_tokens masking and the
presence / frequency / repetition penalties; greedy rows take the argmax, the others are scaled by
temperature, filtered by top-k, top-p and min-p and sampled with per-request generators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedserve.server.request import Request


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # raw log-probability of the sampled token
    rank: int | None = None  # 1 = most likely
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


def sample(logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
    """``logits`` ``[len(requests), vocab]`` fp32, one row per request that needs a new token."""
    logits = logits.float()
    raw_logprobs = _raw_logprobs(logits, requests)
    logits = _apply_logit_bias(logits, requests)
    logits = _mask_stop_tokens_before_min(logits, requests)
    logits = _apply_penalties(logits, requests)
    token_ids = _choose(logits, requests)
    return _with_logprobs(token_ids, raw_logprobs, requests)


def _raw_logprobs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
    if all(r.params.logprobs is None for r in requests):
        return None
    return torch.log_softmax(logits, dim=-1)


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    rows, cols, values = [], [], []
    for row, request in enumerate(requests):
        for token_id, bias in (request.params.logit_bias or {}).items():
            rows.append(row)
            cols.append(int(token_id))
            values.append(float(bias))
    if rows:
        logits = logits.clone()
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(values), accumulate=True)
    return logits


def _mask_stop_tokens_before_min(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    rows, cols = [], []
    for row, request in enumerate(requests):
        if request.num_output_tokens < request.params.min_tokens:
            stop_ids = set(request.params.stop_token_ids or []) | set(request.eos_token_ids)
            rows.extend([row] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        logits = logits.clone()
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    penalised = [
        row for row, r in enumerate(requests)
        if r.params.presence_penalty or r.params.frequency_penalty or r.params.repetition_penalty != 1.0
    ]
    if not penalised:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for row in penalised:
        params = requests[row].params
        output_counts = torch.bincount(
            torch.tensor(requests[row].output_token_ids, dtype=torch.long), minlength=vocab
        )[:vocab].to(logits.device, logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = output_counts > 0
            seen[torch.tensor(requests[row].prompt_token_ids, dtype=torch.long).clamp(max=vocab - 1)] = True
            values = logits[row]
            scaled = torch.where(values > 0, values / params.repetition_penalty,
                                 values * params.repetition_penalty)
            logits[row] = torch.where(seen, scaled, values)
        logits[row] -= params.frequency_penalty * output_counts
        logits[row] -= params.presence_penalty * (output_counts > 0).to(logits.dtype)
    return logits


def _choose(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    chosen = logits.argmax(dim=-1)
    random_rows = [row for row, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits.index_select(0, index), [requests[r] for r in random_rows])
        picks = _exponential_race(probs, [requests[r].generator for r in random_rows])
        chosen[index] = picks
    return chosen.tolist()


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in requests], device=device)
    logits = logits / temperature.unsqueeze(1)
    top_k = torch.tensor([r.params.top_k for r in requests], device=device)
    top_p = torch.tensor([r.params.top_p for r in requests], device=device)
    min_p = torch.tensor([r.params.min_p for r in requests], device=device)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


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


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) samples from p; seeded rows draw E from their own generator."""
    noise = torch.empty_like(probs)
    unseeded = [row for row, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _with_logprobs(
    token_ids: list[int], raw_logprobs: torch.Tensor | None, requests: list[Request]
) -> list[SampledToken]:
    if raw_logprobs is None:
        return [SampledToken(t) for t in token_ids]
    max_k = max(r.params.logprobs or 0 for r in requests)
    chosen = torch.tensor(token_ids, device=raw_logprobs.device).unsqueeze(1)
    chosen_logprobs = raw_logprobs.gather(1, chosen)
    ranks = (raw_logprobs > chosen_logprobs).sum(dim=-1) + 1
    top_values, top_ids = raw_logprobs.topk(max_k, dim=-1) if max_k else (None, None)
    results = []
    for row, (token_id, request) in enumerate(zip(token_ids, requests, strict=False)):
        k = request.params.logprobs
        if k is None:
            results.append(SampledToken(token_id))
            continue
        results.append(SampledToken(
            token_id=token_id,
            logprob=float(chosen_logprobs[row, 0]),
            rank=int(ranks[row]),
            top_ids=top_ids[row, :k].tolist() if k else [],
            top_logprobs=top_values[row, :k].tolist() if k else [],
        ))
    return results
