"""Quantized linear layers on a GPU: the Triton w8a16 (kernels/w8a16_matmul.py) and GGUF-block
(kernels/gguf_matmul.py) matmuls and the FP8 GEMM (kernels/fp8_matmul.py: per-token activation
quantization, then cuBLASLt) against torch's bf16 ``F.linear`` (cuBLAS), at Llama-3-8B's projection
shapes, from one decode row to prefill-sized batches, in one run.

A decode step's few rows are bound by the bytes of the weights: int8 reads half of bf16's, Q4 blocks
about 0.28 of them, so the roofline speed-up at one row is 2x and 3.6x. Batched rows are bound by the
tensor cores, where bf16 cuBLAS is the bar. Each kernel is timed as the engine runs it, inside a CUDA
graph (``common.graph_time``: no host launch cost), over rotating copies of its weights that together
exceed the L2 cache, as a model's layers do. Reports microseconds per call, the weights' bytes over that
time, and each kernel's time over bf16's at the same shape and rows.

``--sweep``: the split-K launch's tiles (kernels/split_k.py and the w8a16 matmul's ``GEMV_*``
constants) at one row on the qkv and down shapes, each configuration's output checked against the
default's.

    python -m pagedserve.benchmarks.gpu.quantized_linear [--rows 1 16 ...] [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagedserve.benchmarks.gpu.common import copy_bandwidth, device_info, graph_time, write_result
from pagedserve.kernels.fp8_matmul import fp8_matmul
from pagedserve.kernels.gguf_matmul import gguf_matmul
from pagedserve.kernels.reference import quantize_fp8_rows
from pagedserve.kernels.testing import GGUF_TYPES, random_gguf_blocks
from pagedserve.kernels.w8a16_matmul import w8a16_matmul
from pagedserve.server.layers.quantization.int8 import quantize_per_channel

# (name, N, K) of Llama-3-8B's merged qkv, o, merged gate_up and down projections.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [1, 16, 64, 256, 1024]
ROTATION_BYTES = 256 << 20  # each kernel's weight copies add up to at least this: more than any L2

KERNELS = ("bf16", "w8a16", "fp8", "gguf-Q8_0", "gguf-Q4_1")
Layer = Callable[[torch.Tensor], torch.Tensor]


def layer(kernel: str, n: int, k: int, seed: int) -> tuple[Layer, int]:
    """One ``[n, k]`` layer of random weights in ``kernel``'s format: (a function of x, its bytes)."""
    gen = torch.Generator().manual_seed(seed)
    if kernel.startswith("gguf-"):
        qtype = GGUF_TYPES[kernel.removeprefix("gguf-")]
        qs, scales, mins = (t.cuda() if t is not None else None for t in random_gguf_blocks(n, k, qtype, gen))
        size = qs.numel() + scales.numel() * 2 + (mins.numel() * 2 if mins is not None else 0)
        return (lambda x: gguf_matmul(x, qs, scales, mins, qtype)), size
    dense = (torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    if kernel == "bf16":
        return (lambda x: F.linear(x, dense)), dense.numel() * 2
    if kernel == "fp8":
        e4m3, channel_scale = quantize_fp8_rows(dense)
        return (lambda x: fp8_matmul(x, e4m3, channel_scale)), e4m3.numel() + channel_scale.numel() * 4
    q8, scale = quantize_per_channel(dense)
    return (lambda x: w8a16_matmul(x, q8, scale)), q8.numel() + scale.numel() * 4


def rotation(kernel: str, n: int, k: int) -> tuple[list[Layer], int]:
    """Copies of one layer with their own weights, together more than any L2 cache; their bytes each."""
    first, nbytes = layer(kernel, n, k, seed=0)
    return [first] + [layer(kernel, n, k, seed)[0] for seed in range(1, -(-ROTATION_BYTES // nbytes))], nbytes


split_k = importlib.import_module("pagedserve.kernels.split_k")
# Per kernel: its module, the constants swept, and the values tried (the defaults first).
SWEEP = {
    "w8a16": ("pagedserve.kernels.w8a16_matmul",
              ("GEMV_BLOCK_N", "GEMV_BLOCK_K", "GEMV_WARPS", "GEMV_STAGES", "PROGRAMS_PER_SM"),
              [(32, 256, 4, 4, 4), (64, 256, 4, 4, 4), (16, 512, 4, 4, 4), (32, 512, 4, 3, 4),
               (32, 256, 4, 4, 8), (64, 128, 4, 4, 8), (32, 256, 8, 4, 4), (128, 128, 4, 4, 2)]),
}


def _configure(module, names: tuple[str, ...], values: tuple[int, ...]) -> None:
    for name, value in zip(names, values, strict=True):
        setattr(split_k if name == "PROGRAMS_PER_SM" else module, name, value)


def sweep(copy_bw: float) -> list[dict]:
    """One-row time of each split-K configuration, on the qkv and down shapes."""
    trials = []
    for kernel, (module_name, names, configs) in SWEEP.items():
        module = importlib.import_module(module_name)
        for shape, n, k in [s for s in SHAPES if s[0] in ("qkv", "down")]:
            copies, nbytes = rotation(kernel, n, k)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            _configure(module, names, configs[0])
            expected = copies[0](x).float()
            for values in configs:
                _configure(module, names, values)
                row = {"kernel": kernel, "shape": shape, "config": dict(zip(names, values, strict=True))}
                try:
                    row["max_diff_vs_default"] = (copies[0](x).float() - expected).abs().max().item()
                    seconds = graph_time([lambda f=f, x=x: f(x) for f in copies])
                    row.update(microseconds=seconds * 1e6, weight_bw_fraction=nbytes / seconds / copy_bw)
                except Exception as exc:  # e.g. out of shared memory for a large tile
                    row["error"] = repr(exc)[:200]
                trials.append(row)
                print(row, flush=True)
            _configure(module, names, configs[0])
            del copies
            torch.cuda.empty_cache()
    return trials


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--sweep", action="store_true", help="time the split-K tiles too")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    copy_bw = copy_bandwidth()
    rows_out = []
    result = {"benchmark": "quantized linear layers vs bf16 cuBLAS, in CUDA graphs", "device": device_info(),
              "copy_bandwidth_gbps": copy_bw / 1e9, "rows": rows_out}
    for shape, n, k in SHAPES:
        kernels = {name: rotation(name, n, k) for name in KERNELS}
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            times = {name: graph_time([lambda f=f, x=x: f(x) for f in copies])
                     for name, (copies, _) in kernels.items()}
            for name, (_, nbytes) in kernels.items():
                rows_out.append({
                    "shape": shape, "n": n, "k": k, "rows": rows, "kernel": name,
                    "microseconds": times[name] * 1e6,
                    "weight_gbps": nbytes / times[name] / 1e9,
                    "weight_bw_fraction": nbytes / times[name] / copy_bw,
                    "time_over_bf16": times[name] / times["bf16"],
                })
                print(f"{shape:8s} rows {rows:5d} {name:10s} {times[name] * 1e6:9.1f} us "
                      f"{nbytes / times[name] / 1e9:7.0f} GB/s  x{times[name] / times['bf16']:.2f} of bf16")
        del kernels
        torch.cuda.empty_cache()
        write_result("quantized_linear", result, args.out, echo=False)  # what a cut run has measured
    if args.sweep:
        result["split_k_sweep"] = sweep(copy_bw)
    write_result("quantized_linear", result, args.out)


if __name__ == "__main__":
    main()
