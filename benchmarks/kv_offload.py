"""The CPU KV tier against recompute. ``python -m pagedserve.benchmarks.kv_offload``.

Two engines on the embedded model with the same small device pool (``--device-blocks``, too small for
the workload's shared prefixes): one with a host-memory KV tier (``kv_offloading_size``), one without,
which recomputes whatever the device pool has evicted. The workload: ``--prefixes`` system prompts of
about ``--prefix-tokens`` tokens, visited in turn for ``--rounds`` rounds, each visit with a new short
question and a short answer (``--max-tokens``), so that every revisit finds its prefix evicted from the
device pool by the others. Requests run one at a time, the two engines alternating request by request
so that load on a shared machine hits both alike. Greedy: both give the same tokens (checked, and
tests/engine/test_kv_offload.py proves it).

Reports, per engine and over the revisits (rounds after the first, where the tier can help): TTFT p50 and
p90 (the engine's first-token time minus the request's arrival), prompt tokens computed, hits from the
tier (tokens) and the TTFT ratio; ``--json`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

QUESTIONS = [
    "What is the first thing you do?", "Summarise your role in one line.", "Which rule matters most?",
    "Answer briefly: are you ready?", "Say hello to the user.", "What must you never do?",
]  # fmt: skip


def system_prompts(tokenizer: Any, count: int, num_tokens: int) -> list[list[int]]:
    """``count`` distinct system prompts of exactly ``num_tokens`` token ids."""
    prompts = []
    for i in range(count):
        rules = " ".join(
            f"Rule {k} of assistant {i}: answer in the manner of persona {i}, step {k}, politely."
            for k in range(80)
        )
        ids = tokenizer.encode(f"You are assistant number {i}. {rules}")
        if len(ids) < num_tokens:
            raise ValueError(f"system prompt {i} has {len(ids)} tokens, fewer than {num_tokens}")
        prompts.append(ids[:num_tokens])
    return prompts


def workload(tokenizer: Any, args: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(round, prompt token ids) in order: every system prompt, round after round."""
    prefixes = system_prompts(tokenizer, args.prefixes, args.prefix_tokens)
    requests = []
    for round_ in range(args.rounds):
        for i, prefix in enumerate(prefixes):
            question = tokenizer.encode(f"\nUser: {QUESTIONS[(i + round_) % len(QUESTIONS)]}\nAssistant:")
            requests.append((round_, [*prefix, *question]))
    return requests


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(ttfts: list[float], computed: int, llm: Any) -> dict[str, Any]:
    tier = llm.engine.core.stats().kv_offload
    return {
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p90_ms": round(1000 * percentile(ttfts, 0.9), 1),
        "prompt_tokens_computed": computed,
        "tier_hits_tokens": tier.hits if tier is not None else 0,
        "tier_load_mib": round(tier.load_bytes / (1 << 20), 1) if tier is not None else 0.0,
        "tier_store_mib": round(tier.store_bytes / (1 << 20), 1) if tier is not None else 0.0,
    }


def run(engines: dict[str, Any], requests: list[tuple[int, list[int]]], max_tokens: int) -> dict[str, Any]:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    computed = dict.fromkeys(engines, 0)
    mismatches = 0
    for round_, prompt in requests:
        tokens = {}
        for name, llm in engines.items():
            (out,) = llm.generate({"prompt_token_ids": prompt}, params)
            tokens[name] = out.outputs[0].token_ids
            if round_ > 0:  # the revisits: the first round is cold for both
                ttfts[name].append(out.metrics.first_token_time - out.metrics.arrival_time)
                computed[name] += len(prompt) - out.num_cached_tokens
        mismatches += len(set(map(tuple, tokens.values()))) > 1
    results = {name: summary(ttfts[name], computed[name], llm) for name, llm in engines.items()}
    off, on = results["recompute"], results["cpu_tier"]
    return {
        **results,
        "ttft_p50_ratio": round(on["ttft_p50_ms"] / off["ttft_p50_ms"], 3),
        "ttft_p90_ratio": round(on["ttft_p90_ms"] / off["ttft_p90_ms"], 3),
        "revisits": len(ttfts["cpu_tier"]),
        "mismatched_outputs": mismatches,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefixes", type=int, default=6, help="distinct system prompts")
    parser.add_argument("--prefix-tokens", type=int, default=400, help="tokens of each system prompt")
    parser.add_argument("--rounds", type=int, default=4, help="visits of each system prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--device-blocks", type=int, default=64, help="device KV blocks of 16 tokens")
    parser.add_argument("--offload-gib", type=float, default=0.25, help="the CPU tier's kv_offloading_size")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)

    from pagedserve import LLM, default_model

    model = str(default_model())
    common = {"num_gpu_blocks_override": args.device_blocks, "max_model_len": args.device_blocks * 16}
    engines = {
        "recompute": LLM(model, **common),
        "cpu_tier": LLM(model, kv_offloading_size=args.offload_gib, **common),
    }
    tokenizer = engines["recompute"].get_tokenizer()
    requests = workload(tokenizer, args)
    from pagedserve import SamplingParams

    for llm in engines.values():  # warm-up, not counted; distinct tokens, so nothing of it is reused
        llm.generate({"prompt_token_ids": list(range(1000, 1040))}, SamplingParams(max_tokens=2))
    results = run(engines, requests, args.max_tokens)
    for name in engines:
        print(f"{name:10s} " + "  ".join(f"{k}={v}" for k, v in results[name].items()))
    print("  ".join(f"{k}={v}" for k, v in results.items() if k not in engines))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({"config": config, **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
