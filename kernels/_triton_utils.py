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
