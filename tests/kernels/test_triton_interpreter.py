"""Runs the interpreter cases (test_triton_kernels.py, test_w8a16_triton.py, test_gguf_triton.py) in a
child pytest with ``TRITON_INTERPRET=1``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pagedserve.kernels._triton_utils import interpreter_active

CASES = Path(__file__).with_name("test_triton_kernels.py")
W8A16_CASES = Path(__file__).with_name("test_w8a16_triton.py")
GGUF_CASES = Path(__file__).with_name("test_gguf_triton.py")
ALL_CASES = (CASES, W8A16_CASES, GGUF_CASES)


@pytest.mark.skipif(interpreter_active(), reason="this process interprets Triton: the cases ran directly")
@pytest.mark.heavy
def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, ALL_CASES)],
        cwd=CASES.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (
        f"interpreter cases failed:\n{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    )
