"""(a) Decode attention bandwidth as a fraction of the measured device-to-device copy bandwidth.

Batch 64, context 2048, Llama-3-8B heads (32 query heads, 8 KV heads, head_dim 128), bf16, block size 16.
Bytes counted: the K and V of every context token (what the kernel must read), plus q, the output and
the block tables. Also timed: the torch reference on the same inputs, the tunables of the Triton kernel
swept (``--sweep``), and the split-K effect at batch 1 and long contexts (the prefill kernel has its
own benchmark: prefill_attention.py). The fp8 column (``triton_fp8``): the same decode on an FP8
(e4m3) cache with scales, half the K/V bytes; its time against the bf16 cache's is the speed-up the
smaller cache buys, its bandwidth the fraction of the copy bandwidth it reaches on its own bytes.

    python -m pagedserve.benchmarks.gpu.decode_attention_bandwidth [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools

import torch
from pagedserve.benchmarks.gpu.common import copy_bandwidth, cuda_time, device_info, write_result
from pagedserve.kernels import paged_attention_decode, reference

from pagedserve.testing.kernels import fp8_paged_case, make_paged_case

decode_module = importlib.import_module("pagedserve.kernels.paged_attention_decode")
TUNABLES = ("BLOCK_N", "NUM_WARPS", "NUM_STAGES", "PROGRAMS_PER_SM")


def bytes_moved(case) -> int:
    num_kv_heads, head_dim = case.k_cache.shape[2], case.k_cache.shape[3]
    element = case.k_cache.element_size()
    kv = 2 * int(case.context_lens.sum()) * num_kv_heads * head_dim * element
    q_out = 2 * case.q_decode.numel() * case.q_decode.element_size()
    return kv + q_out + case.block_tables.numel() * 4 + case.context_lens.numel() * 4


def measure(case, fn=paged_attention_decode, **scales) -> float:
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 128**-0.5)
    return cuda_time(lambda: fn(*args, **scales), iters=100)


def fp8_column(case, copy_bw: float, bf16_seconds: float) -> dict:
    """The decode kernel on ``case``'s cache stored as FP8 (scales that use about a fifth of e4m3's
    range on these unit-variance values)."""
    fp8, k_scale, v_scale = fp8_paged_case(case, 0.05, 0.05)
    moved = bytes_moved(fp8)
    seconds = measure(fp8, k_scale=k_scale, v_scale=v_scale)
    return {"seconds": seconds, "bytes_moved": moved, "bandwidth_gbps": moved / seconds / 1e9,
            "fraction_of_copy": moved / seconds / copy_bw, "speedup_over_bf16_cache": bf16_seconds / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="try the kernel's tunables, keep the best")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    copy_bw = copy_bandwidth()
    case = make_paged_case([args.context] * args.batch, 32, 8, 128, args.block_size, torch.bfloat16, "cuda")
    moved = bytes_moved(case)
    seconds = measure(case)
    result = {
        "benchmark": "decode attention bandwidth",
        "device": device_info(),
        "shape": {"batch": args.batch, "context": args.context, "num_heads": 32, "num_kv_heads": 8,
                  "head_dim": 128, "block_size": args.block_size, "dtype": "bfloat16"},
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "bytes_moved": moved,
        "triton": {"seconds": seconds, "bandwidth_gbps": moved / seconds / 1e9,
                   "fraction_of_copy": moved / seconds / copy_bw,
                   "config": {k: getattr(decode_module, k) for k in TUNABLES}},
    }
    result["triton_fp8"] = fp8_column(case, copy_bw, seconds)
    ref_seconds = measure(case, reference.paged_attention_decode)
    result["torch_reference"] = {"seconds": ref_seconds, "bandwidth_gbps": moved / ref_seconds / 1e9,
                                 "fraction_of_copy": moved / ref_seconds / copy_bw}

    if args.sweep:
        defaults = {k: getattr(decode_module, k) for k in TUNABLES}
        trials = []
        for values in itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (2, 4, 8)):
            config = dict(zip(TUNABLES, values, strict=True))
            for name, value in config.items():
                setattr(decode_module, name, value)
            try:
                t = measure(case)
            except Exception as exc:  # e.g. out of shared memory for a large tile
                trials.append({"config": config, "error": repr(exc)[:200]})
                continue
            trials.append({"config": config, "seconds": t, "fraction_of_copy": moved / t / copy_bw})
        for name, value in defaults.items():
            setattr(decode_module, name, value)
        ok = sorted((t for t in trials if "seconds" in t), key=lambda t: t["seconds"])
        result["sweep"] = {"best": ok[:5], "trials": len(trials), "failed": len(trials) - len(ok)}

    # Split-K: one sequence with a long context, with the automatic split and forced to one partition.
    long_runs = []
    for batch, context in ((1, 16384), (4, 32768), (64, 512)):
        long_case = make_paged_case([context] * batch, 32, 8, 128, 16, torch.bfloat16, "cuda")
        lm = bytes_moved(long_case)
        width_tokens = long_case.block_tables.shape[1] * 16
        splits = decode_module._partition(batch, 8, width_tokens, long_case.q_decode.device)[0]
        t_auto = measure(long_case)
        one_partition = functools.partial(decode_module._decode, num_splits=1, partition=width_tokens)
        t_one = measure(long_case, one_partition)
        long_runs.append({"batch": batch, "context": context, "num_splits": splits,
                          "fraction_of_copy_split_k": lm / t_auto / copy_bw,
                          "fraction_of_copy_one_partition": lm / t_one / copy_bw,
                          "fp8": fp8_column(long_case, copy_bw, t_auto)})
        del long_case
        torch.cuda.empty_cache()
    result["split_k"] = long_runs
    write_result("a_decode_attention_bandwidth", result, args.out)


if __name__ == "__main__":
    main()
