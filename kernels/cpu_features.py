"""What this CPU can run: its instruction-set flags, and the ISA level the CPU kernels are picked by.

The flags come from ``/proc/cpuinfo`` (torch's own checks tell only "AVX2" or "AVX512", not VNNI, BF16
or AMX apart). ``PAGEDSERVE_CPU_ISA`` caps them, so one machine can run the path a lesser CPU runs:
``avx2`` drops every AVX512 and AMX flag, ``generic`` every SIMD flag the kernels use. ``emulation_env``
is the whole environment of such a run: the same cap for oneDNN (``ONEDNN_MAX_CPU_ISA``), ATen's own
kernels (``ATEN_CPU_CAPABILITY``) and MKL (``MKL_ENABLE_INSTRUCTIONS``), read by those libraries when the
process starts, so it is
given to a new process (tests/kernels/test_cpu_isa_matrix.py, benchmarks), never set from inside one.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "PAGEDSERVE_CPU_ISA"
# Each level and the flags it needs, best first; the kernels are built once per level
# (kernels/cpu_build.py FLAVOURS) and a CPU runs the first whose flags it has.
ISA_LEVELS: dict[str, frozenset[str]] = {
    "avx512vnni": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "generic": frozenset(),
}
# The flags a cap to each level leaves; oneDNN's and ATen's names for the same level.
_CAP_DROPS = {"avx2": ("avx512", "amx"), "generic": ("avx", "fma", "f16c", "amx")}
_ONEDNN_ISA = {"avx2": "AVX2", "generic": "SSE41"}
_ATEN_ISA = {"avx2": "avx2", "generic": "default"}
_MKL_ISA = {"avx2": "AVX2", "generic": "SSE4_2"}


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    cap: str | None  # the PAGEDSERVE_CPU_ISA level these flags were capped to, if any

    @property
    def isa(self) -> str:
        """The best ISA level whose flags this CPU has."""
        return next(level for level, needed in ISA_LEVELS.items() if needed <= self.flags)

    @property
    def native_bf16(self) -> bool:
        """A bfloat16 dot product in hardware (AVX512-BF16 or AMX-BF16): oneDNN's bfloat16 GEMM is then
        faster than float32; elsewhere oneDNN emulates it, or has no bfloat16 GEMM at all."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def missing(self, level: str) -> list[str]:
        """The flags of ``level`` this CPU lacks (a skip reason names them)."""
        return sorted(ISA_LEVELS[level] - self.flags)

    def describe(self) -> str:
        extra = [name for name in ("avx512_bf16", "amx_bf16") if name in self.flags]
        text = "+".join([self.isa, *extra])
        return f"{text} (capped by {ISA_ENV}={self.cap})" if self.cap else text


@functools.cache
def cpu_features() -> CpuFeatures:
    """This CPU's flags, capped by ``PAGEDSERVE_CPU_ISA`` when it is set."""
    flags = _cpuinfo_flags()
    cap = os.environ.get(ISA_ENV, "").strip().lower() or None
    if cap is not None:
        if cap not in ISA_LEVELS:
            raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)}, got {cap!r}")
        drops = _CAP_DROPS.get(cap, ())
        flags = frozenset(flag for flag in flags if not flag.startswith(drops))
    return CpuFeatures(flags, cap)


def emulation_env(level: str) -> dict[str, str]:
    """The environment variables that make a new process run as a CPU of ``level`` at most."""
    if level not in _ONEDNN_ISA:
        raise ValueError(f"can emulate {', '.join(_ONEDNN_ISA)}, not {level!r}")
    return {ISA_ENV: level, "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[level], "ATEN_CPU_CAPABILITY": _ATEN_ISA[level],
            "MKL_ENABLE_INSTRUCTIONS": _MKL_ISA[level]}


def _cpuinfo_flags() -> frozenset[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return _torch_flags()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return _torch_flags()


def _torch_flags() -> frozenset[str]:
    """Without /proc/cpuinfo: what torch's capability string tells (AVX512 taken as no VNNI)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return ISA_LEVELS["avx2"] if capability in ("AVX2", "AVX512") else frozenset()
