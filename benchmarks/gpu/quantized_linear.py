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

The w8a16 decode rows run the launch tuned for the GPU (benchmarks/gpu/tune_w8a16.py), as the engine does.

    python -m pagedserve.benchmarks.gpu.quantized_linear [--rows 1 16 ...] [--out DIR]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagedserve.benchmarks.gpu.common import copy_bandwidth, device_info, graph_time, write_result
from pagedserve.kernels.fp8_matmul import fp8_matmul
from pagedserve.kernels.gguf_matmul import gguf_matmul
from pagedserve.kernels.reference import quantize_fp8_rows
from pagedserve.kernels.w8a16_matmul import w8a16_matmul
from pagedserve.server.layers.quantization.int8 import quantize_per_channel

from pagedserve.testing.kernels import GGUF_TYPES, random_gguf_blocks

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
    dense = dense_weight(n, k, gen)
    if kernel == "bf16":
        return (lambda x: F.linear(x, dense)), dense.numel() * 2
    if kernel == "fp8":
        e4m3, channel_scale = quantize_fp8_rows(dense)
        return (lambda x: fp8_matmul(x, e4m3, channel_scale)), e4m3.numel() + channel_scale.numel() * 4
    q8, scale = quantize_per_channel(dense)
    return (lambda x: w8a16_matmul(x, q8, scale)), q8.numel() + scale.numel() * 4


def dense_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A random ``[n, k]`` bf16 weight on the GPU, at a checkpoint's scale."""
    return (torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16)


def copies_beyond_l2(nbytes: int) -> int:
    """How many copies of ``nbytes`` of weights add up to ROTATION_BYTES."""
    return -(-ROTATION_BYTES // nbytes)


def rotation(kernel: str, n: int, k: int) -> tuple[list[Layer], int]:
    """Copies of one layer with their own weights, together more than any L2 cache; their bytes each."""
    first, nbytes = layer(kernel, n, k, seed=0)
    return [first] + [layer(kernel, n, k, seed)[0] for seed in range(1, copies_beyond_l2(nbytes))], nbytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
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
    write_result("quantized_linear", result, args.out)


if __name__ == "__main__":
    main()
