"""Batched LoRA shrink + expand: the device's fast path against the reference and the base projection.

    OMP_WAIT_POLICY=PASSIVE python -m pagedserve.benchmarks.lora_ops [--tokens 1 8 32 512] \
        [--adapters 1 4] [--rank 16] [--repeats 20]

For each projection of the embedded model (SmolLM2-135M: qkv 576 -> 960, gate_up 576 -> 3072, down
1536 -> 576), each batch size (1, 8, 32: decode steps; 512: a prefill chunk) and each number of adapters
(1: every token on slot 0; 4: tokens spread round-robin over four slots), times one LoRA delta
(``lora_shrink`` then ``lora_expand`` into the projection's output) three ways: the reference
(kernels/reference.py, the ``torch`` backend: a ``[T, R, in]`` weight gather per call), the fast path
(on a CPU the ``cpu`` backend's grouped path, kernels/cpu.py; on CUDA the Triton kernels, kernels/lora.py),
and, for scale, the base projection alone (``linear``, server/layers/linear.py). The fast path is checked
against the reference before timing. Prints best-of-N milliseconds per call, the reference/fast ratio
and the LoRA delta's cost relative to the base projection; numbers move with other load on the machine:
compare rows from one run.
"""

from __future__ import annotations

import argparse
from types import ModuleType

import torch
from pagedserve.benchmarks.moe_layer import best_ms
from pagedserve.kernels import cpu, reference
from pagedserve.server.layers.linear import linear

from pagedserve.testing.kernels import make_lora_case

PROJECTIONS = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576)}


def fast_kernels(device: torch.device) -> tuple[str, ModuleType]:
    if device.type == "cuda":
        from pagedserve.kernels import lora

        return "triton", lora
    return "cpu backend", cpu


def lora_delta(kernels: ModuleType, case, y: torch.Tensor) -> torch.Tensor:
    buf = kernels.lora_shrink(case.x, case.lora_a, case.token_slots)
    return kernels.lora_expand(y, buf, case.lora_b, case.token_slots)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on a CPU, bfloat16 on CUDA")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    fast_name, fast = fast_kernels(device)
    print(f"LoRA shrink + expand, rank {args.rank}, {dtype}, {device}")
    print(f"{'projection':>16} {'adapters':>8} {'tokens':>6} {'base linear':>12} {'reference':>12} "
          f"{fast_name:>12} {'ref/fast':>9} {'fast/base':>9}")  # fmt: skip
    for name, (in_features, out_features) in PROJECTIONS.items():
        weight = torch.randn(out_features, in_features, device=device).to(dtype) * in_features**-0.5
        for num_adapters in args.adapters:
            for num_tokens in args.tokens:
                slots = [t % num_adapters for t in range(num_tokens)]
                case = make_lora_case(
                    slots, num_adapters, args.rank, in_features, out_features, dtype=dtype, device=device
                )
                expected = lora_delta(reference, case, case.y.clone())
                error = (lora_delta(fast, case, case.y.clone()).float() - expected.float()).abs().max().item()
                assert error <= (1e-4 if dtype == torch.float32 else 5e-2), f"paths disagree by {error}"
                y, x = case.y.clone(), case.x
                base_ms = best_ms(lambda x=x, w=weight: linear(x, w), args.repeats, device)
                ref_ms = best_ms(lambda c=case, y=y: lora_delta(reference, c, y), args.repeats, device)
                fast_ms = best_ms(lambda c=case, y=y: lora_delta(fast, c, y), args.repeats, device)
                print(f"{f'{name} {in_features}->{out_features}':>16} {num_adapters:>8} {num_tokens:>6} "
                      f"{base_ms:>9.3f} ms {ref_ms:>9.3f} ms {fast_ms:>9.3f} ms {ref_ms / fast_ms:>8.2f}x "
                      f"{fast_ms / base_ms:>8.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
