"""The CPU kernels' builds, one per ISA level (kernels/cpu_build.py), each checked on this machine.

This process runs the best level its CPU has; the levels below it run in a child process capped to them
(kernels/cpu_features.py ``emulation_env``: our kernels, oneDNN and ATen all limited to that ISA), which
runs the CPU kernel and GGUF tests again there. So an AVX512 machine also checks what an AVX2-only one
runs (the AVX2 kernels, float32 copies for batched GGUF rows, oneDNN without a bfloat16 inner product),
and an AVX2 machine skips only the AVX512 level, naming the flags it lacks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pagedserve.kernels import cpu, cpu_build
from pagedserve.kernels.cpu_features import ISA_LEVELS, cpu_features, emulation_env

# The tests a capped child runs: every CPU kernel against its reference, and the GGUF layers and model.
CHILD_TESTS = [
    "tests/kernels/test_cpu_kernels.py",
    "tests/kernels/test_gguf_cpu.py",
    "tests/kernels/test_w8a16_cpu.py",
    "tests/kernels/test_fp8_kv.py",
    "tests/models/test_gguf_layers.py",
]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_this_process_runs_the_best_prebuilt_level() -> None:
    """No start compiles: `make setup` built every level, and the CPU's best one is loaded from there."""
    library = cpu.loaded_library()
    assert library is not None, "the CPU kernels did not load (see the warning above)"
    assert library.level == cpu_features().isa
    assert library.origin == "prebuilt", f"{library}: `make setup` builds them (kernels/cpu_build.py)"
    assert library.path.parent == cpu_build.PREBUILT


# The generic level (x86-64 without AVX2, or another architecture) in make test-heavy only.
LEVELS = [pytest.param(name, marks=pytest.mark.heavy) if name == "generic" else name for name in ISA_LEVELS]


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_matches_the_references(level: str) -> None:
    features = cpu_features()
    if features.missing(level):
        pytest.skip(f"this CPU lacks {', '.join(features.missing(level))} for the {level} kernels")
    if level == features.isa:
        pytest.skip(f"{level} is this process's own level: the tests beside this one ran it")
    env = {**os.environ, **emulation_env(level), "PYTHONSAFEPATH": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not heavy",
               "-W", "ignore::pytest.PytestUnknownMarkWarning", *CHILD_TESTS,
               "tests/kernels/test_cpu_isa_matrix.py::test_this_process_runs_the_best_prebuilt_level"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
