"""The mixture-of-experts layer: the fused expert path against the per-expert loop, side by side.

    OMP_WAIT_POLICY=PASSIVE python -m pagedserve.benchmarks.moe_layer [--tokens 1 8 64 256] \
        [--experts 64] [--top-k 8] [--hidden 1024] [--intermediate 384] [--repeats 20]

One ``FusedMoE`` layer (server/layers/fused_moe.py: router, top-k, experts), run once with the per-expert
loop (``kernels/reference.py``, the ``torch`` backend, as HF Transformers runs its experts) and once with
the fused path of the device's backend: on a CPU the ``cpu`` backend's grouped path (kernels/cpu.py), on
CUDA the Triton kernel (kernels/fused_moe.py). Both share the same weights and inputs; the two outputs
are checked to agree before timing. Prints best-of-N milliseconds per call and the ratio, per batch size
(tokens: 1 is a decode step of one sequence, 256 a prefill chunk). The defaults are Qwen3-30B-A3B's
routing (128 experts, top 8) at a quarter of its widths and half its experts, to fit a CPU's memory;
numbers move with other load on the machine: compare rows from one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from types import ModuleType

import torch
from pagedserve.kernels import cpu, reference
from pagedserve.server.layers.fused_moe import FusedMoE, MoESpec


def best_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed()  # warm-up: Triton compiles here
    return min(timed() for _ in range(repeats)) * 1000


def fused_kernels(device: torch.device) -> tuple[str, ModuleType]:
    if device.type == "cuda":
        import pagedserve.kernels as triton_kernels

        return "triton", triton_kernels
    return "cpu backend", cpu


def make_layer(spec: MoESpec, hidden: int, kernels: ModuleType, dtype: torch.dtype, device: torch.device):
    layer = FusedMoE(spec, hidden, None, kernels, dtype, device)
    generator = torch.Generator(device=device).manual_seed(0)
    for param in layer.parameters():  # same seed: both layers get the same weights
        param.copy_(torch.randn(param.shape, generator=generator, device=device) / param.shape[-1] ** 0.5)
    return layer


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384, help="of one expert")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on a CPU, bfloat16 on CUDA")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    spec = MoESpec(args.experts, args.top_k, args.intermediate, True, frozenset({0}))
    fused_name, fused = fused_kernels(device)
    loop_layer = make_layer(spec, args.hidden, reference, dtype, device)
    fused_layer = make_layer(spec, args.hidden, fused, dtype, device)
    print(f"MoE layer: {args.experts} experts, top {args.top_k}, hidden {args.hidden}, expert width "
          f"{args.intermediate}, {dtype}, {device}")  # fmt: skip
    print(f"{'tokens':>6} {'per-expert loop':>16} {fused_name:>16} {'ratio':>8}")
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, args.hidden, generator=torch.Generator().manual_seed(num_tokens))
        x = x.to(device=device, dtype=dtype)
        error = (fused_layer(x).float() - loop_layer(x).float()).abs().max().item()
        assert error <= (1e-3 if dtype == torch.float32 else 5e-2), f"paths disagree by {error}"
        loop_ms = best_ms(lambda x=x: loop_layer(x), args.repeats, device)
        fused_ms = best_ms(lambda x=x: fused_layer(x), args.repeats, device)
        print(f"{num_tokens:>6} {loop_ms:>13.3f} ms {fused_ms:>13.3f} ms {loop_ms / fused_ms:>7.2f}x")


if __name__ == "__main__":
    main()
