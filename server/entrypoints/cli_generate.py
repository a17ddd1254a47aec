"""`pagedserve generate "prompt"`: offline generation from the command line."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompt text (one or more)")
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: the embedded model)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")


def run(args: argparse.Namespace) -> int:
    from pagedserve.server.entrypoints.llm import LLM
    from pagedserve.server.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        if args.chat:
            conversations = [[{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(conversations, params)
        else:
            outputs = llm.generate(args.prompts, params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompts, outputs, strict=False):
        for completion in output.outputs:
            label = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{label}{prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0
