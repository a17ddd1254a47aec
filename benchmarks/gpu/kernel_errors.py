"""Each Triton kernel's largest error against its torch reference at real shapes, bf16 inputs, the
reference run in float32 on the same inputs (the tests in tests/gpu hold each to a tolerance; this
records the numbers): ``max_abs_error`` and ``max_abs_error / max |reference|``.

    python -m pagedserve.benchmarks.gpu.kernel_errors [--out DIR]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pagedserve.kernels as triton_kernels
import torch
from pagedserve.benchmarks.gpu.common import device_info, write_result
from pagedserve.kernels import reference
from pagedserve.server.layers.quantization.int8 import quantize_per_channel
from pagedserve.server.layers.rotary import build_cos_sin_cache
from transformers import LlamaConfig

from pagedserve.testing.kernels import GGUF_TYPES, make_paged_case, random_gguf_blocks

BF16 = torch.bfloat16
CUDA = torch.device("cuda")


def _fp32(args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() and a.dtype != torch.float8_e4m3fn
                 else a for a in args)


def _error(actual: Any, expected: Any) -> dict[str, float]:
    pairs = zip(actual, expected, strict=True) if isinstance(actual, tuple) else [(actual, expected)]
    worst, scale = 0.0, 0.0
    for a, e in pairs:
        worst = max(worst, (a.float() - e.float()).abs().max().item())
        scale = max(scale, e.float().abs().max().item())
    return {"max_abs_error": worst, "relative_to_max": worst / scale if scale else 0.0}


def cases() -> dict[str, tuple[Callable, Callable, tuple]]:
    """name: (kernel, reference, bf16 arguments)."""
    gen = torch.Generator(device=CUDA).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=CUDA) * scale).to(BF16)

    decode = make_paged_case([1, 64, 2048, 700, 1500] * 12 + [97] * 4, 32, 8, 128, 16, BF16, CUDA)
    prefill = make_paged_case([1, 64, 1500, 700, 2048, 300, 97], 32, 8, 128, 16, BF16, CUDA,
                              q_lens=[1, 64, 1500, 200, 512, 1, 5])
    int8, int8_scale = quantize_per_channel(torch.randn(6144, 4096, generator=gen, device=CUDA) * 0.02)
    q4 = [t.to(CUDA) if t is not None else None
          for t in random_gguf_blocks(4096, 14336, GGUF_TYPES["Q4_1"], torch.Generator().manual_seed(0))]
    rope = build_cos_sin_cache(LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                           max_position_embeddings=8192), 128, 8192).to(CUDA)
    positions = torch.randint(0, 8192, (1000,), generator=gen, device=CUDA)
    return {
        "paged_attention_decode": (triton_kernels.paged_attention_decode, reference.paged_attention_decode,
                                   (decode.q_decode, decode.k_cache, decode.v_cache, decode.block_tables,
                                    decode.context_lens, 128**-0.5)),
        "paged_attention_prefill": (triton_kernels.paged_attention_prefill, reference.paged_attention_prefill,
                                    (prefill.q_prefill, prefill.k_cache, prefill.v_cache,
                                     prefill.block_tables, prefill.cu_seqlens_q, prefill.context_lens,
                                     128**-0.5)),
        "rms_norm": (triton_kernels.rms_norm, reference.rms_norm,
                     (rand(1000, 4096), 1 + rand(4096, scale=0.1), 1e-5)),
        "fused_add_rms_norm": (triton_kernels.fused_add_rms_norm, reference.fused_add_rms_norm,
                               (rand(1000, 4096), rand(1000, 4096), 1 + rand(4096, scale=0.1), 1e-5)),
        "apply_rotary": (triton_kernels.apply_rotary, reference.apply_rotary,
                         (rand(1000, 32, 128), rand(1000, 8, 128), positions, rope)),
        "silu_and_mul": (triton_kernels.silu_and_mul, reference.silu_and_mul, (rand(300, 2 * 14336),)),
        "w8a16_matmul_1_row": (triton_kernels.w8a16_matmul, reference.w8a16_matmul,
                               (rand(1, 4096), int8, int8_scale, None)),
        "w8a16_matmul_64_rows": (triton_kernels.w8a16_matmul, reference.w8a16_matmul,
                                 (rand(64, 4096), int8, int8_scale, None)),
        "gguf_matmul_q4_1_1_row": (triton_kernels.gguf_matmul, _dequantized_gguf,
                                   (rand(1, 14336), *q4, GGUF_TYPES["Q4_1"])),
        "gguf_matmul_q4_1_64_rows": (triton_kernels.gguf_matmul, _dequantized_gguf,
                                     (rand(64, 14336), *q4, GGUF_TYPES["Q4_1"])),
    }


def _dequantized_gguf(x, qs, scales, mins, qtype):
    """The GPU kernel's spec: float activations times the dequantized blocks (kernels/gguf_matmul.py)."""
    return x.float() @ reference.dequantize_gguf(qs, scales, mins, qtype).float().T


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    errors = {}
    for name, (kernel, ref, inputs) in cases().items():
        errors[name] = _error(kernel(*inputs), ref(*_fp32(inputs)))
        print(name, errors[name], flush=True)
    write_result("kernel_errors", {"benchmark": "Triton kernels vs fp32 references, bf16 inputs",
                                   "device": device_info(), "kernels": errors}, args.out)


if __name__ == "__main__":
    main()
