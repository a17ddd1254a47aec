"""The INT8 weight-only matmul candidates on this CPU, at the embedded model's projection shapes.

Per (N, K) and rows M: the fp32 projection the engine runs without quantization (oneDNN,
server/layers/linear.py ``linear``), our C++ kernel (kernels/csrc/w8a16_cpu.cpp), torch's
``aten._weight_int8pack_mm`` (per-channel int8; bf16 activations, the dtype it is fast in) and
dequantize-then-fp32-GEMM (what kernels/cpu.py runs above ``W8A16_MAX_NATIVE_ROWS``).

``--gguf-step`` instead loads the embedded model in gguf mode and times, per row count, its GGUF
projections and head one after another, as a decode step runs them (so the weights stream from memory,
not from cache): the int8 x int8 block kernel (kernels/csrc/gguf_cpu.cpp), the dense copy (bfloat16 or
float32, by the CPU: kernels/cpu.py ``dense_dtype``) as ``gguf_dense_weight`` keeps it (packed into
oneDNN's layout), and the same copy as a plain matrix. This is what ``GGUF_DENSE_ROWS`` is set from.
Times are the best of ``--repeats`` rounds of ``--calls`` calls, rounds interleaved across candidates so
that load from other processes hits them alike; CPU time of this process with ``--cpu-time`` (less
sensitive to a shared machine; one thread then).

    PYTHONSAFEPATH=1 OMP_WAIT_POLICY=PASSIVE python -m pagedserve.benchmarks.quantized_linear [--threads 2]
        [--gguf-step]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

# (N, K): qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, and the tied LM head 576->49152.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = [1, 4, 8, 16, 32, 64]
GGUF_STEP_ROWS = [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 64]


def candidates(x, weight, q, scale) -> dict[str, Callable[[], object]]:
    import torch
    from pagedserve.kernels import cpu
    from pagedserve.server.layers.linear import linear

    ops = cpu.load_extension()
    x_bf16, scale_bf16 = x.bfloat16(), scale.bfloat16()
    return {
        "fp32": lambda: linear(x, weight),
        "ours": lambda: ops.w8a16_matmul(x, q, scale, None),
        "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x_bf16, q, scale_bf16),
        "dequant": lambda: linear(x, q.to(torch.float32) * scale[:, None]),
    }


def best_of(candidates: dict[str, Callable[[], object]], calls: int, repeats: int, clock) -> dict[str, float]:
    best = dict.fromkeys(candidates, float("inf"))
    for fn in candidates.values():
        fn()
    for _ in range(repeats):
        for name, fn in candidates.items():
            t = clock()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (clock() - t) / calls * 1e6)
    return best


def gguf_step_candidates(layers: list, plain: dict, x_by_width: dict) -> dict[str, Callable[[], object]]:
    """One decode step's GGUF products, each way: every layer in model order on rows of its width.
    ``plain``: each layer's copy as a plain matrix, by ``id(layer)``."""
    from pagedserve.kernels import cpu

    ops = cpu.load_extension()

    def step(product: Callable) -> Callable[[], None]:
        def run() -> None:
            for layer in layers:
                product(layer, x_by_width[layer.gguf_shape[1]])
        return run

    return {
        "int8 blocks": step(lambda layer, x: ops.gguf_matmul(
            x, layer.weight, layer.weight_scales, layer.weight_mins, layer.gguf_type, None)),
        "dense packed": step(lambda layer, x: cpu.dense_matmul(x, layer.weight_dense)),
        "dense plain": step(lambda layer, x: cpu.dense_matmul(x, plain[id(layer)])),
    }


def gguf_step(args: argparse.Namespace, clock) -> None:
    import torch
    from pagedserve.kernels import cpu

    from pagedserve import LLM

    llm = LLM(quantization="gguf")
    model = llm.engine.core.executor.model
    layers = [m for m in model.modules() if getattr(m, "weight_dense", None) is not None]
    assert layers, "no dense copies: the CPU kernels or oneDNN are missing (kernels/cpu.py)"
    widths = {layer.gguf_shape[1] for layer in layers}
    plain = {id(layer): layer.weight_dense.to_dense() for layer in layers}  # unpacked once, for all rows
    dtype = str(cpu.dense_dtype()).removeprefix("torch.")
    print(f"{len(layers)} GGUF layers, {dtype} copies, ms per step (all of them once)")
    print("| rows | int8 blocks | dense packed | dense plain |")
    print("| --- | --- | --- | --- |")
    for m in GGUF_STEP_ROWS:
        x_by_width = {k: torch.randn(m, k) for k in widths}
        times = best_of(gguf_step_candidates(layers, plain, x_by_width), 1, args.repeats, clock)
        print(f"| {m} | " + " | ".join(f"{t / 1e3:.1f}" for t in times.values()) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time (sets one thread)")
    parser.add_argument("--gguf-step", action="store_true", help="the embedded model's GGUF layers per step")
    args = parser.parse_args(argv)
    import torch
    from pagedserve.kernels import cpu
    from pagedserve.server.layers.quantization.int8 import quantize_per_channel

    torch.set_num_threads(1 if args.cpu_time else args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    assert cpu.load_extension() is not None, "the CPU kernels did not build"
    print(f"threads {torch.get_num_threads()}, {'CPU' if args.cpu_time else 'wall'} time")
    if args.gguf_step:
        gguf_step(args, clock)
        return
    print("| N x K | rows | fp32 (oneDNN) | int8 ours | int8pack_mm bf16 | dequant + fp32 GEMM "
          "| fp32 / ours |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, k in SHAPES:
        weight = torch.randn(n, k) * 0.05
        q, scale = quantize_per_channel(weight)
        for m in ROWS:
            times = best_of(candidates(torch.randn(m, k), weight, q, scale), args.calls, args.repeats, clock)
            print(f"| {n} x {k} | {m} | {times['fp32']:.0f} | {times['ours']:.0f} | {times['int8pack']:.0f} "
                  f"| {times['dequant']:.0f} | {times['fp32'] / times['ours']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
