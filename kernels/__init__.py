"""Triton kernels of the engine, each beside a pure-torch reference with the same signature.

``pagedserve.kernels.<name>`` is the Triton kernel, ``pagedserve.kernels.reference.<name>`` its reference
(kernels/reference.py: the engine's ``torch`` backend; kernels/cpu.py is its ``cpu`` backend, and
server/backend.py chooses among the three). Importing this package needs no GPU: kernels compile at their
first launch, and in a process started with ``TRITON_INTERPRET=1`` they run in Triton's CPU interpreter
instead. Without Triton installed at all the names still import, and calling one raises ``ImportError``.
"""

from . import reference

KERNELS = (
    "store_kv_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "fused_add_rms_norm",
    "apply_rotary",
    "silu_and_mul",
    "fused_moe",
    "w8a16_matmul",
    "gguf_matmul",
    "fp8_matmul",
    "lora_shrink",
    "lora_expand",
)

try:
    from .apply_rotary import apply_rotary
    from .fp8_matmul import fp8_matmul
    from .fused_moe import fused_moe
    from .gguf_matmul import gguf_matmul
    from .lora import lora_expand, lora_shrink
    from .paged_attention_decode import paged_attention_decode
    from .paged_attention_prefill import paged_attention_prefill
    from .rms_norm import fused_add_rms_norm, rms_norm
    from .silu_and_mul import silu_and_mul
    from .store_kv_cache import store_kv_cache
    from .w8a16_matmul import w8a16_matmul
except ImportError as exc:  # no triton on this platform
    _reason = str(exc)

    def _unavailable(name: str):
        def kernel(*args, **kwargs):
            raise ImportError(f"pagedserve.kernels.{name} needs Triton: {_reason}")

        kernel.__name__ = name
        return kernel

    for _name in KERNELS:
        globals()[_name] = _unavailable(_name)

__all__ = [
    "KERNELS",
    "apply_rotary",
    "fp8_matmul",
    "fused_add_rms_norm",
    "fused_moe",
    "gguf_matmul",
    "lora_expand",
    "lora_shrink",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reference",
    "rms_norm",
    "silu_and_mul",
    "store_kv_cache",
    "w8a16_matmul",
]
