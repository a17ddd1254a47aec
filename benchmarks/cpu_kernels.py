"""The CPU backend's kernels against what they replace, at the embedded model's shapes.

    OMP_WAIT_POLICY=PASSIVE python -m pagedserve.benchmarks.cpu_kernels [--batch 64] [--context 340] \
        [--repeats 30]

Prints, per kernel, the best-of-N time of the torch reference (or ``F.linear``, MKL's sgemm) and of the
CPU backend (C++ ops; oneDNN for the projections), and the ratio. The linear rows run the decoder's
121 projections back to back with distinct weights, as a forward does, so the weights come from memory
and not from cache. Numbers move with other load on the machine: compare rows from one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu, reference
from pagedserve.server.layers.linear import linear

from pagedserve.testing.kernels import make_paged_case

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, LAYERS = 576, 9, 3, 64, 1536, 49152, 30


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def report(name: str, before: float, after: float) -> None:
    print(f"{name:<44} {before:9.3f} ms {after:9.3f} ms {before / after:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64, help="decode sequences")
    parser.add_argument("--context", type=int, default=340, help="mean context length")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    assert cpu.load_extension() is not None, "the CPU kernels did not build"
    torch.manual_seed(0)
    title = f"kernel (batch {args.batch})"
    print(f"{title:<44} {'reference':>12} {'cpu backend':>12} {'ratio':>8}")

    lens = torch.randint(args.context // 2, args.context * 3 // 2, (args.batch,)).tolist()
    case = make_paged_case(lens, HEADS, KV_HEADS, HEAD_DIM, 16)
    decode = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, HEAD_DIM**-0.5)
    report(
        f"paged_attention_decode (context ~{args.context})",
        best_ms(lambda: reference.paged_attention_decode(*decode), args.repeats),
        best_ms(lambda: cpu.paged_attention_decode(*decode), args.repeats),
    )

    x, residual = torch.randn(args.batch, HIDDEN), torch.randn(args.batch, HIDDEN)
    weight = torch.randn(HIDDEN)
    gate_up = torch.randn(args.batch, 2 * INTERMEDIATE)
    q, k = torch.randn(args.batch, HEADS, HEAD_DIM), torch.randn(args.batch, KV_HEADS, HEAD_DIM)
    positions, cos_sin = torch.randint(0, 2048, (args.batch,)), torch.randn(2048, HEAD_DIM)
    elementwise = {
        "rms_norm": lambda m: m.rms_norm(x, weight, 1e-5),
        "fused_add_rms_norm": lambda m: m.fused_add_rms_norm(x, residual, weight, 1e-5),
        "silu_and_mul": lambda m: m.silu_and_mul(gate_up),
        "apply_rotary": lambda m: m.apply_rotary(q, k, positions, cos_sin),
    }
    for name, call in elementwise.items():
        before = best_ms(lambda call=call: call(reference), args.repeats)
        report(name, before, best_ms(lambda call=call: call(cpu), args.repeats))

    shapes = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE),
              (INTERMEDIATE, HIDDEN)] * LAYERS + [(HIDDEN, VOCAB)]  # fmt: skip
    weights = [torch.randn(out_features, in_features) for in_features, out_features in shapes]
    for rows in sorted({1, 8, args.batch, 2048}):
        inputs = {n: torch.randn(rows, n) for n in (HIDDEN, INTERMEDIATE)}

        def forward(fn: Callable, inputs: dict = inputs) -> None:
            for (in_features, _), w in zip(shapes, weights, strict=True):
                fn(inputs[in_features], w)

        report(
            f"121 projections, {rows} rows (F.linear -> oneDNN)",
            best_ms(lambda: forward(F.linear), max(3, args.repeats // 10)),
            best_ms(lambda: forward(linear), max(3, args.repeats // 10)),
        )


if __name__ == "__main__":
    main()
