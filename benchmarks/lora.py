"""Many LoRA adapters against the base model alone, on one workload. ``python -m pagedserve.benchmarks.lora``.

Issue 17's figure: output tok/s of a batch whose requests are spread over 4 adapters, against the same
batch sent to the base model, goal >= 0.7x on CPU. Three engines on the embedded model, each fed the same
prompts in one ``LLM.generate`` call (continuous batching does the mixing):

- base: an engine without LoRA (what a base-model-only deployment runs);
- base-on-lora: the LoRA engine serving the base model (what enabling LoRA alone costs);
- mixed: the LoRA engine, request ``i`` under adapter ``i % 4`` (all four resident: ``max_loras=4``).

Adapters are seeded PEFT adapters made by pagedserve/testing/lora.py ``make_peft_adapter`` (rank 16 on
every projection, the heaviest common case). Every request generates exactly ``--max-tokens`` tokens
(``ignore_eos``), so the three runs produce the same number of tokens and the ratio is speed alone. The
rounds alternate engine by engine so load on a shared machine hits all three alike; the best round of each
is reported with the ratios.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle gear works to a ten year old.",
    "List five things to check before a long car journey.",
    "Describe the water cycle in a few sentences.",
    "What makes a good cup of tea?",
    "Give advice to someone starting to learn the piano.",
    "Summarise the rules of chess in plain words.",
    "Why is the sky blue?",
]


def timed_generate(llm: Any, prompts: list[str], params: Any, loras: list[Any] | None) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)

    from pagedserve import LLM, LoRARequest, SamplingParams, default_model
    from pagedserve.testing.lora import ALL_LINEAR, make_peft_adapter

    model = str(default_model())
    workdir = Path(tempfile.mkdtemp(prefix="pagedserve-lora-bench-"))
    loras = [
        LoRARequest(
            f"adapter{i}",
            i + 1,
            str(make_peft_adapter(model, workdir / f"a{i}", args.rank, ALL_LINEAR, seed=i)),
        )
        for i in range(args.adapters)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    kv = {"kv_cache_memory_bytes": 256 << 20}
    base = LLM(model, **kv)
    lora = LLM(model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **kv)
    runs = {
        "base": (base, None),
        "base-on-lora": (lora, None),
        "mixed": (lora, [loras[i % len(loras)] for i in range(len(prompts))]),
    }
    for llm, mapping in runs.values():  # warm-up: adapters loaded into their slots, kernels built
        timed_generate(
            llm, prompts[: len(loras)], SamplingParams(max_tokens=4), mapping and mapping[: len(loras)]
        )
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, (llm, mapping) in runs.items():
            seconds, tokens = timed_generate(llm, prompts, params, mapping)
            best[name] = max(best.get(name, 0.0), tokens / seconds)
    figures = {name: round(tps, 1) for name, tps in best.items()}
    figures["mixed_vs_base"] = round(best["mixed"] / best["base"], 3)
    figures["base_on_lora_vs_base"] = round(best["base-on-lora"] / best["base"], 3)
    workload = f"{args.num_requests} requests x {args.max_tokens} tokens"
    print(f"{workload}, {args.adapters} adapters of rank {args.rank}")
    print("  ".join(f"{k}={v}" for k, v in figures.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **figures}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
