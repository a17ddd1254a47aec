"""Speculative decoding at batch 1. ``python -m pagedserve.benchmarks.spec_decode``.

Two engines on the embedded model (in its default mode, gguf on a CPU; ``--model`` names another), one
with ``speculative_config`` (n-gram by default; ``--draft-layers N`` drafts with a model instead: the
embedded model's float32 folder for N = 0, else its first N layers, pagedserve/testing/draft_models.py)
and one without, decode the
same prompts one at a time, alternating prompt by prompt so that load on a shared machine hits both
alike, on two workloads:

- grounded: the output copies the prompt (repeat, rewrite, extract from a passage): drafts are accepted;
- free: open questions whose answers copy nothing: drafting must cost nothing there (issue 18: >= 0.95x).

Greedy, so both engines generate the same tokens (tests/engine/test_spec_decode.py proves it) and the
ratio of output tok/s is the speculation's effect alone. Prints tok/s per side, the acceptance rate
(accepted / drafted tokens) and the ratio; ``--json`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

PASSAGES = [
    "The river flooded the lower town twice in the spring of that year. The council built a wall of "
    "sandbags along the bank, and the school was closed for a week while the water went down.",
    "Our new coffee machine grinds the beans, heats the milk and cleans itself. It takes two minutes to "
    "warm up in the morning and can make twelve cups before the water tank must be filled again.",
    "Maria moved to Lisbon in 2019 to work as a nurse at the central hospital. She learned Portuguese in "
    "six months, bought a small flat near the river and now teaches first aid on Saturdays.",
    "The museum opens at nine and closes at five, except on Mondays, when it is closed all day. Tickets "
    "cost twelve euros for adults and six for students; children under ten enter for free.",
]
GROUNDED_TEMPLATES = [
    "Repeat the following text exactly, word for word.\n\n{passage}",
    "Rewrite the following text in the same words, as one paragraph.\n\n{passage}",
    "Copy every sentence of this text that contains a number.\n\n{passage}",
]
FREE = [
    "Write a short poem about autumn leaves.",
    "Give me three ideas for a birthday party for a ten year old.",
    "Why do cats purr?",
    "Describe your ideal weekend.",
    "What should I pack for a hiking trip in the mountains?",
    "Invent a name and a slogan for a new bakery.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def grounded_prompts() -> list[str]:
    return [t.format(passage=p) for t in GROUNDED_TEMPLATES for p in PASSAGES]


def run(prompts: list[str], base: Any, spec: Any, max_tokens: int) -> dict[str, float]:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    stats_before = spec.engine.core.stats().spec_decoding
    drafted0, accepted0 = stats_before.num_draft_tokens, stats_before.num_accepted_tokens
    seconds = {"base": 0.0, "spec": 0.0}
    tokens = {"base": 0, "spec": 0}
    mismatches = 0
    for prompt in prompts:
        outs = {}
        for name, llm in (("spec", spec), ("base", base)):
            messages = [{"role": "user", "content": prompt}]
            start = time.perf_counter()
            (out,) = llm.chat(messages, params)
            seconds[name] += time.perf_counter() - start
            tokens[name] += len(out.outputs[0].token_ids)
            outs[name] = out.outputs[0].token_ids
        mismatches += outs["spec"] != outs["base"]
    stats = spec.engine.core.stats().spec_decoding
    drafted, accepted = stats.num_draft_tokens - drafted0, stats.num_accepted_tokens - accepted0
    base_tps, spec_tps = tokens["base"] / seconds["base"], tokens["spec"] / seconds["spec"]
    return {
        "prompts": len(prompts),
        "output_tokens": tokens["spec"],
        "base_tok_s": round(base_tps, 1),
        "spec_tok_s": round(spec_tps, 1),
        "ratio": round(spec_tps / base_tps, 3),
        "draft_tokens": drafted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "mismatched_outputs": mismatches,
    }


def draft_folder(model: str, num_layers: int) -> str:
    """The draft model's folder: the target itself (0), or its first layers cut into a temporary folder."""
    if num_layers == 0:
        return model
    import tempfile

    from pagedserve.testing.draft_models import truncated_draft

    return str(truncated_draft(model, tempfile.mkdtemp(prefix="draft-"), num_layers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="draft with a model: 0 the target itself, N its first N layers (overrides "
                             "--speculative-config)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="with --draft-layers")
    parser.add_argument("--prompts", type=int, default=None, help="only the first N prompts of each workload")
    parser.add_argument("--model", default=None,
                        help="target model (default: the embedded one in its default mode, gguf on a CPU; "
                             "its converted folder for the float32 weights)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)

    from pagedserve import LLM, default_model

    folder = str(default_model())  # the float32 weights a draft model is cut from
    if args.draft_layers is not None:
        draft = {"model": draft_folder(folder, args.draft_layers),
                 "num_speculative_tokens": args.num_speculative_tokens}
        args.speculative_config = json.dumps(draft)
    kv = {"kv_cache_memory_bytes": 256 << 20}
    base = LLM(args.model, **kv)
    spec = LLM(args.model, speculative_config=args.speculative_config, **kv)
    print(f"target {args.model or 'the embedded model'}, quantization {base.engine.core.config.quantization}")
    warm = ["Hello there."]
    run(warm, base, spec, 8)
    results = {
        "grounded": run(grounded_prompts()[: args.prompts], base, spec, args.max_tokens),
        "free": run(FREE[: args.prompts], base, spec, args.max_tokens),
    }
    for name, figures in results.items():
        print(f"{name:9s} " + "  ".join(f"{k}={v}" for k, v in figures.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speculative_config": json.loads(args.speculative_config), **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
