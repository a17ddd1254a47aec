"""Speculative decoding through ``LLM`` on the embedded model, by n-gram and by a draft model (the embedded
model cut to its first layers, pagedserve/testing/draft_models.py): greedy output identical to the same
engine without speculation, under every scheduling regime, and sampling at temperature > 0 distributed as
without it. Held-out prompts: some copy their input (drafts are accepted), some do not."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.testing.draft_models import truncated_draft

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Drafting is off above disable_by_batch_size running requests; these tests batch more than its default.
NGRAM_ANY_BATCH = {**NGRAM, "disable_by_batch_size": 512}
# The draft model keeps this many of the target's 30 layers: it agrees with the target often, not always.
DRAFT_LAYERS = 20
# The draft method reruns the n-gram checks with a drafter model: `make test-heavy` (minutes of CPU).
METHODS = ["ngram", pytest.param("draft", marks=pytest.mark.heavy)]

PASSAGE = ("The committee met on Tuesday to review the budget for the new library. After a long discussion "
           "about heating costs and the price of books, the members agreed to spend less on furniture.")
PROMPTS = [
    f"Repeat the following text word for word.\nText: {PASSAGE}\nRepeated text: The committee",
    "Count: 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    f"Extract the names of the things the committee discussed.\n{PASSAGE}\nThings:",
    "Write a short poem about the sea.",  # nothing to copy
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def draft_path(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(truncated_draft(model_path, tmp_path_factory.mktemp("draft"), DRAFT_LAYERS))


@pytest.fixture(scope="module")
def spec_configs(draft_path: str) -> dict[str, dict[str, Any]]:
    draft = {"model": draft_path, "num_speculative_tokens": 3, "disable_by_batch_size": 512}
    return {"ngram": NGRAM_ANY_BATCH, "draft": draft}


@pytest.fixture(scope="module", params=METHODS)
def spec_llm(request: pytest.FixtureRequest, model_path: str, spec_configs: dict[str, dict[str, Any]]) -> LLM:
    return LLM(model_path, speculative_config=spec_configs[request.param])


def token_ids(llm: LLM, prompts: list[Any], params: Any) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def assert_idle(llm: LLM) -> None:
    core = llm.engine.core
    assert not core.scheduler.has_unfinished() and not core.kv.req_blocks
    assert core.kv.usage() == 0.0, "blocks still referenced"


def spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.core.stats().spec_decoding
    assert stats is not None
    return stats.num_draft_tokens, stats.num_accepted_tokens


def test_greedy_output_is_identical_and_drafts_are_accepted(llm: LLM, spec_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48)
    before = spec_counts(spec_llm)
    assert token_ids(spec_llm, PROMPTS, params) == token_ids(llm, PROMPTS, params)
    drafted, accepted = (a - b for a, b in zip(spec_counts(spec_llm), before, strict=True))
    assert 0 < accepted <= drafted
    assert_idle(spec_llm)


def test_greedy_one_at_a_time_with_the_default_batch_limit(llm: LLM, model_path: str) -> None:
    """batch 1, as a single user sees it, with the shipped disable_by_batch_size."""
    spec = LLM(model_path, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    for prompt in PROMPTS[:3] + PROMPTS[4:5]:
        assert token_ids(spec, [prompt], params) == token_ids(llm, [prompt], params)
    assert spec_counts(spec)[1] > 0
    assert_idle(spec)


def test_greedy_one_at_a_time_in_the_default_gguf_mode(model_path: str) -> None:
    """The embedded model as `make serve` runs it (its GGUF blocks, int8 activations at batch 1), where
    quantizing activations turns a different summation order into other tokens: a draft's verification
    attends position by position through the decode kernel (server/worker/model_runner.py), so its logits
    are bit for bit those of decoding one token at a time."""
    plain, spec = LLM(), LLM(speculative_config=NGRAM)
    assert spec.engine.core.config.quantization == "gguf"
    params = SamplingParams(temperature=0.0, max_tokens=48)
    # Chat questions whose answers verified as one prefill chunk left the plain engine's after 12-32 tokens
    for question in ["Invent a name and a slogan for a new bakery.", "Describe your ideal weekend.",
                     "Give me three ideas for a birthday party for a ten year old.", PROMPTS[0]]:
        messages = [{"role": "user", "content": question}]
        (want,), (got,) = plain.chat(messages, params), spec.chat(messages, params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, question
    assert spec_counts(spec)[1] > 0
    assert_idle(spec)


def test_max_tokens_and_stop_tokens_landing_mid_draft(llm: LLM, spec_llm: LLM) -> None:
    """A draft run accepted past max_tokens or past a stop token is cut at it; the tokens after it drop."""
    prompts = PROMPTS[:3] * 4
    lengths = (1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in lengths]
    assert token_ids(spec_llm, prompts, params) == token_ids(llm, prompts, params)
    (reference,) = token_ids(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=30))
    for index in (4, 9, 14):
        stop = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[reference[0][index]])
        (got,) = token_ids(spec_llm, PROMPTS[:1], stop)
        (want,) = token_ids(llm, PROMPTS[:1], stop)
        assert got == want and len(got[0]) <= index + 1
    assert_idle(spec_llm)


def test_n_stop_strings_and_logprobs(llm: LLM, spec_llm: LLM) -> None:
    stop = ["furniture", "3, 1, 2, 3, 1"]
    params = SamplingParams(temperature=0.0, max_tokens=40, n=2, logprobs=3, stop=stop)
    want = llm.generate(PROMPTS, params)
    got = spec_llm.generate(PROMPTS, params)
    for w, g in zip(want, got, strict=True):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert (gc.text, gc.token_ids, gc.finish_reason, gc.stop_reason) == (
                wc.text, wc.token_ids, wc.finish_reason, wc.stop_reason)
            assert gc.logprobs is not None and wc.logprobs is not None
            for g_pos, w_pos in zip(gc.logprobs, wc.logprobs, strict=True):
                assert list(g_pos) == list(w_pos)  # the same tokens, in the same order
                for token in w_pos:
                    assert g_pos[token].logprob == pytest.approx(w_pos[token].logprob, abs=2e-3)
    assert any(c.stop_reason == "furniture" for o in got for c in o.outputs)
    assert_idle(spec_llm)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-16"),  # the budget also cuts the drafts
        # 12 blocks of 16 hold about two of these sequences: the others are preempted while drafting
        pytest.param({"num_gpu_blocks_override": 12, "max_model_len": 160}, id="preemption"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
    ],
)
def test_greedy_identical_under_scheduling_regimes(
    llm: LLM, model_path: str, engine_args: dict[str, Any], method: str,
    spec_configs: dict[str, dict[str, Any]],
) -> None:
    spec = LLM(model_path, speculative_config=spec_configs[method], **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    assert token_ids(spec, PROMPTS, params) == token_ids(llm, PROMPTS, params)
    if "num_gpu_blocks_override" in engine_args:
        assert spec.engine.core.scheduler.num_preemptions > 0
    assert spec_counts(spec)[1] > 0
    assert_idle(spec)


def test_prefix_cache_never_holds_a_rejected_draft(llm: LLM, spec_llm: LLM) -> None:
    """Blocks filled while drafting are registered in the prefix cache only with accepted tokens' KV: a
    second request whose prompt is the first one's prompt and output reuses them and must still match."""
    params = SamplingParams(temperature=0.0, max_tokens=64)
    tokenizer = spec_llm.get_tokenizer()
    for prompt in PROMPTS[:4]:
        prompt_ids = tokenizer.encode(prompt)
        (first,) = token_ids(spec_llm, [prompt], params)
        follow_up = {"prompt_token_ids": prompt_ids + first[0] + prompt_ids[:8]}
        hits_before = spec_llm.engine.core.kv.prefix_hits
        assert token_ids(spec_llm, [follow_up], params) == token_ids(llm, [follow_up], params)
        assert spec_llm.engine.core.kv.prefix_hits - hits_before >= len(prompt_ids + first[0]) // 16 * 16 - 16
    assert_idle(spec_llm)


def test_seeded_sampling_is_reproducible(spec_llm: LLM) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=s) for s in range(len(PROMPTS))]
    assert token_ids(spec_llm, PROMPTS, params) == token_ids(spec_llm, PROMPTS, params)


# ---- temperature > 0: the distribution is unchanged -----------------------------------------------------

COUNTING = "Count: 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,"  # next " 2" is likely, not certain: drafts get rejected
SAMPLES = 400


def chi_square_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square over the categories both samples share often enough (the rest pooled)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    common = [c for c in set(a) | set(b) if (a[c] + b[c]) * min(total_a, total_b) / (total_a + total_b) >= 5]
    rows = [(a[c], b[c]) for c in common]
    rows.append((total_a - sum(r[0] for r in rows), total_b - sum(r[1] for r in rows)))
    rows = [r for r in rows if sum(r) > 0]
    stat = 0.0
    for count_a, count_b in rows:
        pooled = (count_a + count_b) / (total_a + total_b)
        for count, total in ((count_a, total_a), (count_b, total_b)):
            expected = pooled * total
            stat += (count - expected) ** 2 / expected
    return stat, len(rows) - 1


def critical_value(df: int) -> float:
    """chi-square(df) upper 0.1% quantile (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + 3.0902 * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.heavy  # ~26 s of sampling; greedy parity stays in make test
def test_sampled_tokens_after_drafts_keep_the_target_distribution(llm: LLM, spec_llm: LLM) -> None:
    """The 2nd and 3rd tokens of a counting prompt come from verified drafts (the n-gram proposes " 2, 3"
    after the first token); their joint distribution over many seeded samples matches the plain engine's."""
    def pairs(engine: LLM, first_seed: int) -> Counter:
        params = [SamplingParams(temperature=1.0, max_tokens=3, seed=first_seed + i) for i in range(SAMPLES)]
        outputs = engine.generate([COUNTING] * SAMPLES, params)
        return Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outputs)

    drafted_before, accepted_before = spec_counts(spec_llm)
    with_spec, without = pairs(spec_llm, 0), pairs(llm, 10_000)
    drafted, accepted = spec_counts(spec_llm)
    assert drafted - drafted_before >= SAMPLES * 0.9  # nearly every sample verified a draft
    assert 0 < accepted - accepted_before < drafted - drafted_before  # some accepted, some rejected
    stat, df = chi_square_homogeneity(with_spec, without)
    assert df >= 2
    assert stat < critical_value(df), (stat, df, with_spec.most_common(8), without.most_common(8))
    assert_idle(spec_llm)


def test_structured_outputs_verify_drafts_through_the_grammar(llm: LLM, spec_llm: LLM) -> None:
    """Requests with a grammar are drafted for; drafts are checked against the matcher, each verified
    position masked, and the matcher advanced by accepted tokens only: the same constrained output."""
    from pagedserve.server.sampling_params import StructuredOutputsParams

    pattern = r"(ab){6}c"  # repetitive text an n-gram drafts for
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["name", "tags"]}
    regex = SamplingParams(temperature=0.0, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(regex=pattern))
    json_params = SamplingParams(temperature=0.0, max_tokens=48,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    drafted_before, accepted_before = spec_counts(spec_llm)
    (got,) = spec_llm.generate([PROMPTS[1]], regex)
    assert got.outputs[0].text == "ab" * 6 + "c"
    prompts = [PROMPTS[1], PROMPTS[3], "Describe a cat as JSON:", PROMPTS[2]]
    mixed = [regex, json_params, json_params, SamplingParams(temperature=0.0, max_tokens=20)]
    assert token_ids(spec_llm, prompts, mixed) == token_ids(llm, prompts, mixed)
    drafted, accepted = spec_counts(spec_llm)
    assert drafted > drafted_before and accepted > accepted_before
    assert_idle(spec_llm)


def test_grammar_drafts_are_cut_after_the_first_refused_one(llm: LLM) -> None:
    """The matcher keeps the admitted drafts and the first refused one, gives each position its own mask,
    and ends where it began."""
    import torch
    from pagedserve.server.sampling_params import StructuredOutputsParams
    from pagedserve.server.spec_decode.grammar_drafts import check_drafts
    from pagedserve.server.structured_output.bitmask import apply_grammar_bitmask
    from pagedserve.server.structured_output.compiler import GrammarCompiler

    tokenizer = llm.get_tokenizer()
    ab = tokenizer.encode("ab")
    assert len(ab) == 1, ab
    vocab = llm.engine.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab, frozenset({tokenizer.eos_token_id}))
    grammar = compiler.compile(StructuredOutputsParams(regex=r"(ab){3}c")).new_state()
    zz = tokenizer.encode("zz")[0]
    kept, mask = check_drafts(grammar, [ab[0], ab[0], zz, ab[0]])
    assert kept == [ab[0], ab[0], zz]
    assert mask.bits.shape[0] == 4
    allowed = apply_grammar_bitmask(torch.zeros(4, vocab), mask) == 0
    abc = tokenizer.encode("abc")[0]  # llguidance admits the one token that ends "ababab c" here
    assert allowed[0, ab[0]] and allowed[1, ab[0]] and allowed[2, abc] and not allowed[2, zz]
    assert torch.equal(mask.bits[3], mask.bits[2])  # after the refused draft: never sampled from
    assert grammar.accept(ab[0]) and grammar.accept(ab[0]) and grammar.accept(abc)  # rolled back to the start


def test_a_grammar_waiting_for_the_reasoning_gets_no_drafts_and_a_free_mask(llm: LLM) -> None:
    """While a reasoning model reasons (server/grammar_state.py Phase.THINKING) its grammar takes no token
    and masks none, drafts are not checked against it; after the closing tag both hold again."""
    from pagedserve.server.grammar_state import Phase
    from pagedserve.server.sampling_params import StructuredOutputsParams, ThinkGate
    from pagedserve.server.spec_decode.grammar_drafts import check_drafts
    from pagedserve.server.structured_output.compiler import GrammarCompiler

    tokenizer = llm.get_tokenizer()
    ab, zz = tokenizer.encode("ab")[0], tokenizer.encode("zz")[0]
    end, start = tokenizer.encode("!")[0], tokenizer.encode("?")[0]  # stand-ins for the think tags
    compiler = GrammarCompiler(tokenizer, llm.engine.vocab_size, frozenset({tokenizer.eos_token_id}))
    constraint = StructuredOutputsParams(regex=r"(ab){3}c")
    grammar = compiler.compile(constraint).new_state(ThinkGate(start, end, thinks_from_start=True))
    kept, mask = check_drafts(grammar, [zz, zz])
    assert kept == [] and bool((mask.bits == -1).all())
    assert grammar.accept(zz) and grammar.accept(zz) and grammar.phase is Phase.THINKING
    assert grammar.accept(end) and grammar.phase is Phase.ANSWERING
    assert not grammar.accept(zz)  # the answer is the grammar's
    deciding = compiler.compile(constraint).new_state(ThinkGate(start, end, thinks_from_start=False))
    assert deciding.phase is Phase.DECIDING and deciding.accept(ab) and deciding.phase is Phase.ANSWERING


# ---- the draft model's mechanics: its own cache over the target's blocks --------------------------------


@pytest.mark.heavy
def test_self_draft_is_accepted_whole_and_its_cache_follows_the_target(llm: LLM, model_path: str) -> None:
    """The target as its own draft: every greedy draft is accepted only if the drafter's K/V is right at
    every position (filled by the mirrored prefill, kept over accepted drafts, valid on prefix-cache hits).
    With the mirror switched off the drafter reads stale K/V and most drafts are rejected; the output
    stays the target's either way."""
    spec = LLM(model_path, speculative_config={"model": model_path, "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = PROMPTS[1:3] + PROMPTS[4:5]
    for attempt in ("cold", "prefix hit"):
        before = spec_counts(spec)
        for prompt in prompts:  # batch 1: under the default disable_by_batch_size
            assert token_ids(spec, [prompt], params) == token_ids(llm, [prompt], params)
        drafted, accepted = (a - b for a, b in zip(spec_counts(spec), before, strict=True))
        assert drafted >= 3 * len(prompts) and accepted >= 0.95 * drafted, (attempt, drafted, accepted)
    assert spec.engine.core.kv.prefix_hits > 0
    runner = spec.engine.core.executor.runner
    assert runner.drafter is not None
    runner.drafter.mirror = lambda *args: None  # type: ignore[method-assign]
    spec.engine.core.kv.reset_prefix_cache()
    before = spec_counts(spec)
    broken = [PASSAGE, "Name three rivers in Europe."]
    for prompt in broken:
        assert token_ids(spec, [prompt], params) == token_ids(llm, [prompt], params)
    drafted, accepted = (a - b for a, b in zip(spec_counts(spec), before, strict=True))
    assert accepted < 0.5 * drafted, (drafted, accepted)
    assert_idle(spec)


@pytest.mark.heavy
def test_draft_model_cache_is_counted_in_the_kv_budget(model_path: str, draft_path: str) -> None:
    """One block holds the target's and the drafter's K/V: the same byte budget gives fewer blocks."""
    budget = 64 * 2**20
    plain = LLM(model_path, kv_cache_memory_bytes=budget).engine.core.executor
    spec = LLM(model_path, kv_cache_memory_bytes=budget,
               speculative_config={"model": draft_path, "num_speculative_tokens": 2}).engine.core.executor
    assert spec.block_bytes == plain.block_bytes * (30 + DRAFT_LAYERS) // 30
    assert spec.num_blocks == budget // spec.block_bytes < plain.num_blocks
    for layer in spec.runner.drafter.model.attention_layers():  # type: ignore[union-attr]
        assert layer.k_cache.shape[0] == spec.num_blocks
