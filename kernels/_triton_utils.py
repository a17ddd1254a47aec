"""Launch-size helpers and device functions shared by the Triton kernels."""

import functools
import sys

import torch
import triton
import triton.language as tl


def interpreter_active() -> bool:
    """Whether Triton kernels run in the CPU interpreter in this process.

    ``triton.jit`` picks the compiler or the interpreter when a function is decorated, and Triton's own
    standard library (``tl.zeros``, ``tl.cdiv``, ...) is decorated when ``triton`` is first imported, so
    ``TRITON_INTERPRET=1`` only takes effect if it is set before that import: the mode is per process.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules["triton.language.standard"].cdiv, InterpretedFunction)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 4 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dot_dim(n: int) -> int:
    """A tile width for a dimension that a ``tl.dot`` contracts or produces: a power of two, and at least
    16, the smallest a GPU's tensor cores take (head_dim 8 compiles in the interpreter, not on a GPU).
    The kernels mask the padded lanes, so a model of any head size runs."""
    return max(16, next_pow2(n))


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, last_dim]`` tensor whose last dimension is contiguous (no copy if possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def elementwise_warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def softcap_scores(s, softcap):
    """``tanh(x / cap) * cap`` in the kernels' exp2 domain: ``s = x * log2(e)``, ``softcap = cap *
    log2(e)``. tanh from exp2, which the interpreter runs too: ``tanh(y) = 1 - 2 / (exp(2y) + 1)``."""
    exp_2y = tl.exp2((2.0 * 1.4426950408889634) * (s / softcap))  # s / softcap = x / cap
    return (1.0 - 2.0 / (exp_2y + 1.0)) * softcap


def fp8_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """``(is the cache FP8, k_scale, v_scale)`` for a kernel launch. The kernels read the scales of an
    FP8 cache only, where a missing one is 1.0; for any other cache a missing one is a placeholder
    pointer (the cache itself), so the engine's launches allocate nothing."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if k_scale is None or v_scale is None:
        missing = torch.ones(1, dtype=torch.float32, device=k_cache.device) if fp8 else k_cache
        k_scale = missing if k_scale is None else k_scale
        v_scale = missing if v_scale is None else v_scale
    return fp8, k_scale, v_scale


@triton.jit
def saturate_round_e4m3(x):
    """float32 ``x`` clamped to +-448 and rounded to the nearest e4m3 value, ties to even: what
    ``torch.Tensor.to(torch.float8_e4m3fn)`` stores after the clamp. Rounded here, in float32, so that
    the final cast is exact whatever rounding the cast itself does (Triton's CPU interpreter rounds
    ties away from zero and loses the carry into the exponent)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    # The magnitude is rounded and the sign put back with integer ops: a float negation or select of a
    # zero may lose -0's sign to the compiler, and the reference stores -0 as 0x80.
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -0x80000000  # 0x80000000
    magnitude = bits & 0x7FFFFFFF
    # Normal range: keep 3 of float32's 23 mantissa bits, ties to even (a carry moves the exponent on).
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000  # -0x100000 = 0xFFF00000
    # Below 2**-6 e4m3 is subnormal, a fixed step of 2**-9: 24576 = 1.5 * 2**14 has exactly that ulp,
    # so adding and subtracting it rounds to the step, ties to even.
    absolute = magnitude.to(tl.float32, bitcast=True)
    subnormal = ((absolute + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    rounded = tl.where(absolute < 0.015625, subnormal, normal)
    return (rounded | sign).to(tl.float32, bitcast=True)
