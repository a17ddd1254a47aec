"""Prefill attention FLOP/s: the Triton paged kernel (kernels/paged_attention_prefill.py) beside torch's
own fused attention (``scaled_dot_product_attention`` on contiguous K/V, causal), in one run.

Head dims 128 (Llama-3-8B: 32 query heads, 8 KV heads) and 64 (Llama-3.2-1B: 32/8), bf16, block size
16, 16,384 query tokens a launch: 16 prompts of 1,024 tokens, 4 of 4,096, 2 of 8,192, and the mixed
case of the engine's chunked prefill (8 prompts of 1,024 beside 4 chunks of 512 after 1,536 cached
tokens). FLOPs count causal attention only, ``4 * head_dim`` per visible (query, key) pair and head.
SDPA has no paged cache and no chunks: it runs the whole-prompt cases on contiguous ``[batch, heads,
len, head_dim]`` tensors with K/V at the query's head count (the same FLOPs), through the backend torch
picks for bf16 on the GPU. (On the H200 that is not FlashAttention-2: torch's FA2 ran these shapes at
the Triton kernel's speed, SDPA at twice it; by its speed, cuDNN's. The JSON keeps the key
``sdpa_flash_tflops``.)

``--sweep`` times the kernel's tunables (module constants) on the 4,096-token case and checks each
configuration's output against the default's.

    python -m pagedserve.benchmarks.gpu.prefill_attention [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F
from pagedserve.benchmarks.gpu.common import cuda_time, device_info, write_result
from pagedserve.kernels import paged_attention_prefill

from pagedserve.testing.kernels import make_paged_case

prefill_module = importlib.import_module("pagedserve.kernels.paged_attention_prefill")
TUNABLES = ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")
HEADS = {128: (32, 8), 64: (32, 8)}
CASES = {  # name: (context lengths, query lengths)
    "16x1024": ([1024] * 16, [1024] * 16),
    "4x4096": ([4096] * 4, [4096] * 4),
    "2x8192": ([8192] * 2, [8192] * 2),
    "mixed-chunks": ([1024] * 8 + [2048] * 4, [1024] * 8 + [512] * 4),
}
# (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES): the tiles a Hopper attention kernel is usually found at.
SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 2),
         (128, 64, 8, 3), (128, 128, 8, 2)]


def causal_flops(context_lens: list[int], q_lens: list[int], head_dim: int, num_heads: int) -> int:
    """Query i of a chunk sees ``context - q_len + i + 1`` keys."""
    pairs = sum(q * (c - q) + q * (q + 1) // 2 for c, q in zip(context_lens, q_lens, strict=True))
    return 4 * pairs * head_dim * num_heads


def paged_case(head_dim: int, context_lens: list[int], q_lens: list[int]):
    num_heads, num_kv_heads = HEADS[head_dim]
    case = make_paged_case(context_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda",
                           q_lens=q_lens)
    return (case.q_prefill, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
            case.context_lens, head_dim**-0.5)


def sdpa_tflops(head_dim: int, context_lens: list[int], flops: int) -> float:
    """torch's SDPA on the same prompts, each a contiguous ``[heads, len, head_dim]`` batch."""
    num_heads, _ = HEADS[head_dim]
    length, batch = context_lens[0], len(context_lens)
    q, k, v = (torch.randn(batch, num_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    seconds = cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters=20)
    return flops / seconds / 1e12


def measure(head_dim: int) -> dict:
    out = {}
    for name, (context_lens, q_lens) in CASES.items():
        flops = causal_flops(context_lens, q_lens, head_dim, HEADS[head_dim][0])
        args = paged_case(head_dim, context_lens, q_lens)
        seconds = cuda_time(lambda args=args: paged_attention_prefill(*args), iters=20)
        row = {"flops": flops, "triton_tflops": flops / seconds / 1e12}
        if context_lens == q_lens:
            row["sdpa_flash_tflops"] = sdpa_tflops(head_dim, context_lens, flops)
            row["triton_over_sdpa"] = row["triton_tflops"] / row["sdpa_flash_tflops"]
        out[name] = row
        print(f"d{head_dim} {name:14s} " + " ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
        del args
        torch.cuda.empty_cache()
    return out


def sweep(head_dim: int) -> list[dict]:
    context_lens, q_lens = CASES["4x4096"]
    flops = causal_flops(context_lens, q_lens, head_dim, HEADS[head_dim][0])
    args = paged_case(head_dim, context_lens, q_lens)
    defaults = {k: getattr(prefill_module, k) for k in TUNABLES}
    expected = paged_attention_prefill(*args).float()
    trials = []
    for values in SWEEP:
        config = dict(zip(TUNABLES, values, strict=True))
        for name, value in config.items():
            setattr(prefill_module, name, value)
        try:
            error = (paged_attention_prefill(*args).float() - expected).abs().max().item()
            seconds = cuda_time(lambda: paged_attention_prefill(*args), iters=10, warmup=2)
            trials.append({"config": config, "tflops": flops / seconds / 1e12, "max_diff_vs_default": error})
        except Exception as exc:  # e.g. out of shared memory for a large tile
            trials.append({"config": config, "error": repr(exc)[:200]})
    for name, value in defaults.items():
        setattr(prefill_module, name, value)
    return sorted(trials, key=lambda t: -t.get("tflops", 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="time the kernel's tunables too")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"benchmark": "prefill attention FLOP/s, Triton paged kernel vs torch SDPA",
              "device": device_info(), "dtype": "bfloat16", "block_size": 16,
              "config": {k: getattr(prefill_module, k) for k in TUNABLES},
              "head_dims": {str(d): measure(d) for d in HEADS}}
    write_result("prefill_attention", result, args.out, echo=False)  # what a cut run has measured
    if args.sweep:
        result["sweep_4x4096"] = {str(d): sweep(d) for d in HEADS}
    write_result("prefill_attention", result, args.out)


if __name__ == "__main__":
    main()
