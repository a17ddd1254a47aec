"""Speculative decoding without a model: the config, the n-gram proposer, the rejection rule on synthetic
distributions (its output must be distributed exactly as the target's), and the acceptance estimate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from pagedserve.server.config import EngineConfig
from pagedserve.server.spec_decode.ngram import propose_ngram
from pagedserve.server.spec_decode.rejection_sampler import accept_drafts
from pagedserve.server.speculative_config import SpeculativeConfig


def chi_square_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper ``alpha`` quantile of chi-square(df), Wilson-Hilferty (within 1% for df >= 3)."""
    z = {1e-3: 3.0902, 1e-2: 2.3263}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 came out"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ---- config --------------------------------------------------------------------------------------------


def test_ngram_config_from_vllm_dict_and_json() -> None:
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    )
    assert cfg is not None and (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (
        3, 4, 2)
    default = SpeculativeConfig.parse({"num_speculative_tokens": 2})
    assert default is not None and default.method == "ngram"
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    one = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert one is not None and (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    engine = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert isinstance(engine.speculative_config, SpeculativeConfig)
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0, "prompt_lookup_max": 2}, "must be >= 1"),
        ({"num_speculative_tokens": 2, "lookahead": 3}, r"unknown keys \['lookahead'\]"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' needs 'model'"),
        ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to method 'ngram' only"),
        ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, "'draft_model' only"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a dict"),
    ],
)
def test_bad_speculative_config_is_a_value_error_at_start_up(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine_args", "message"),
    [
        ({"tensor_parallel_size": 2}, "not supported with tensor or pipeline parallelism"),
        ({"kv_offloading_size": 1.0}, "not supported with kv_offloading_size"),
    ],
)
def test_draft_model_refusals_at_start_up(engine_args: dict, message: str) -> None:
    draft = {"model": "some/draft", "num_speculative_tokens": 2}
    assert EngineConfig(speculative_config=draft).speculative_config.method == "draft_model"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=draft, **engine_args)


def test_draft_model_must_share_the_vocabulary() -> None:
    from types import SimpleNamespace

    from pagedserve.server.spec_decode.draft_model import check_draft_config

    check_draft_config(SimpleNamespace(vocab_size=49152), SimpleNamespace(vocab_size=49152))
    with pytest.raises(ValueError, match=r"vocab_size \(259\) differs from the target's \(49152\)"):
        check_draft_config(SimpleNamespace(vocab_size=49152), SimpleNamespace(vocab_size=259))


def test_server_flag_reaches_the_engine_config() -> None:
    import argparse

    from pagedserve.server.api.cli import add_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    config = engine_config(parser.parse_args(["--speculative-config", json.dumps(spec)]))
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert config.speculative_config.to_dict() | spec == config.speculative_config.to_dict()


# ---- n-gram proposer -----------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = np.array([1, 2, 3, 9, 8, 7, 1, 2, 3, 5, 6, 4, 0, 2, 3])
    # "2 3" occurs at 1 and 7; the latest (7) is followed by 5 6 4
    assert propose_ngram(tokens, 2, 3, 3) == [5, 6, 4]
    # with the suffix "0 2 3" unmatched, n=3 finds nothing and n=2 decides
    assert propose_ngram(tokens, 3, 3, 3) == []
    # the longest n wins over a later shorter one
    tokens = np.array([5, 2, 3, 10, 11, 7, 3, 20, 5, 2, 3])
    assert propose_ngram(tokens, 1, 3, 2) == [10, 11]
    assert propose_ngram(tokens, 1, 1, 2) == [20, 5]
    # a repeating text: the latest match with k tokens after it, else the earliest (the most after it)
    assert propose_ngram(np.array([1, 2, 3, 1, 2, 3, 1, 2]), 1, 2, 4) == [3, 1, 2, 3]
    assert propose_ngram(np.array([4, 4]), 1, 2, 5) == [4]
    assert propose_ngram(np.array([1, 2, 3, 4]), 1, 2, 5) == []
    assert propose_ngram(np.array([7]), 1, 2, 5) == []


# ---- rejection sampler ---------------------------------------------------------------------------------


def _run_rejection(probs: torch.Tensor, draft_probs: torch.Tensor | None, trials: int,
                   seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    k, vocab = probs.shape[0] - 1, probs.shape[1]
    q = draft_probs if draft_probs is not None else torch.full((k, vocab), 1.0 / vocab)
    outputs = []
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=generator).squeeze(1)
        outputs.append(accept_drafts(probs, drafts, draft_probs, generator).tolist())
    return outputs


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft-distribution", "point-mass"])
def test_rejection_sampler_output_is_distributed_as_the_target(with_draft_probs: bool) -> None:
    vocab, k, trials = 6, 2, 6000
    g = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    probs[0, 5] = 0.0  # a token the target never emits, though drafts propose it
    probs = probs / probs.sum(dim=-1, keepdim=True)
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=g), dim=-1) if with_draft_probs else None
    outputs = _run_rejection(probs, draft_probs, trials, seed=3)
    assert all(1 <= len(o) <= k + 1 for o in outputs)
    first = np.bincount([o[0] for o in outputs], minlength=vocab)
    assert chi_square(first, probs[0].numpy()) < chi_square_critical(vocab - 1)
    # the token after an accepted draft follows the target's next distribution
    second = np.bincount([o[1] for o in outputs if len(o) > 1], minlength=vocab)
    assert second.sum() > trials / 10
    assert chi_square(second, probs[1].numpy()) < chi_square_critical(vocab - 1)


def test_rejection_sampler_is_reproducible_with_a_seeded_generator() -> None:
    probs = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(1)), dim=-1)
    assert _run_rejection(probs, None, 50, seed=11) == _run_rejection(probs, None, 50, seed=11)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_acceptance_estimate_shortens_then_pauses_drafting(method: str) -> None:
    """One mechanism for both methods: a draft model's drafts are counted here (PENDING, drawn by the
    runner in the verifying step), an n-gram's looked up."""
    from pagedserve.server.outputs import RequestMetrics
    from pagedserve.server.request import Request
    from pagedserve.server.sampling_params import SamplingParams
    from pagedserve.server.spec_decode.proposer import (
        COOLDOWN_STEPS,
        PENDING,
        DraftProposer,
        record_acceptance,
    )

    if method == "ngram":
        cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1)
    else:
        cfg = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=4)
    proposer = DraftProposer(cfg, max_model_len=1000)
    request = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(), max_tokens=100,
                      eos_token_ids=frozenset(), metrics=RequestMetrics(arrival_time=0.0))
    proposer.propose([request], num_running=1)
    assert request.spec_token_ids == ([3, 1, 2, 3] if method == "ngram" else [PENDING] * 4)
    lengths = []
    while request.spec_cooldown == 0:  # nothing accepted, step after step
        record_acceptance(request, len(request.spec_token_ids), 0)
        proposer.propose([request], num_running=1)
        lengths.append(len(request.spec_token_ids))
    assert lengths[0] == 4 and lengths[-1] == 0 and 1 <= min(lengths[:-1]) < 4  # shortened, then paused
    assert len(lengths) < 10
    for _ in range(COOLDOWN_STEPS - 1):
        proposer.propose([request], num_running=1)
        assert request.spec_token_ids == []  # paused
    proposer.propose([request], num_running=1)
    assert request.spec_token_ids  # a probe after the pause
    proposer.propose([request], num_running=cfg.disable_by_batch_size + 1)
    assert request.spec_token_ids == []  # a compute-bound batch is not drafted for
    # drafts never run past max_tokens: the last token is always the target's own
    request.max_tokens = request.num_output_tokens + 2
    request.spec_acceptance, request.spec_cooldown = 1.0, 0
    proposer.propose([request], num_running=1)
    assert len(request.spec_token_ids) == 1


# ---- scheduling drafts ---------------------------------------------------------------------------------


def test_scheduler_fits_drafts_to_the_budget_and_drops_them_before_preempting() -> None:
    from pagedserve.server.core.kv_cache_manager import KVCacheManager
    from pagedserve.server.core.scheduler import Scheduler
    from pagedserve.server.outputs import RequestMetrics
    from pagedserve.server.request import Request
    from pagedserve.server.sampling_params import SamplingParams

    def request(request_id: str, prompt: list[int]) -> Request:
        return Request(request_id, prompt, SamplingParams(), max_tokens=100, eos_token_ids=frozenset(),
                       metrics=RequestMetrics(0.0))

    block = 4
    kv = KVCacheManager(5, block, enable_caching=True, hash_seed="m")  # 20 tokens
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=3)
    a = request("a", [1, 2, 3])
    scheduler.add(a)
    (item,) = scheduler.schedule().scheduled
    a.num_computed_tokens += item.num_new_tokens
    a.output_token_ids.append(4)  # 4 tokens, one block, 3 computed
    a.spec_token_ids = [5, 6, 7, 8]
    (item,) = scheduler.schedule().scheduled
    assert (item.num_new_tokens, item.spec_token_ids) == (3, [5, 6])  # the budget of 3 cuts the drafts
    assert item.completes_sequence
    assert kv.req_num_cached["a"] == 1  # only the block of known tokens is registered, never a draft's
    assert len(kv.blocks_of("a")) == 2
    # one draft accepted and a bonus token: 6 known tokens, 5 computed (the core clears the drafts)
    a.num_computed_tokens += 2
    a.spec_token_ids = []
    a.output_token_ids += [5, 9]
    b = request("b", list(range(100, 111)))  # 11 tokens: the other 3 blocks
    scheduler.max_num_batched_tokens = 100
    scheduler.add(b)
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 11)]
    assert kv.pool.num_free_blocks == 0
    for s in plan.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        s.request.output_token_ids.append(1)
    a.spec_token_ids = [7, 7, 7, 7]  # would need a third block for "a": none is free
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.spec_token_ids) for s in plan.scheduled] == [
        ("a", 1, []), ("b", 1, [])]
    assert not plan.preempted and scheduler.num_preemptions == 0
    scheduler.finish(a, a.status)
    scheduler.finish(b, b.status)
    assert kv.usage() == 0.0
