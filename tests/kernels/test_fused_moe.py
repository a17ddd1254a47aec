"""The mixture-of-experts MLP: the reference against a dense formula, the cpu backend's grouped path
against the reference, and (in a child process with Triton's interpreter) the Triton kernel."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu, reference

from pagedserve.testing.kernels import make_moe_case

TRITON_CASES = Path(__file__).with_name("test_fused_moe_triton.py")


def dense_moe(hidden, w13, w2, topk_weights, topk_ids):
    """Every expert on every token, combined by a [T, E] weight matrix: no gathers, no loop."""
    gate_up = torch.einsum("th,eoh->teo", hidden, w13)
    gate, up = gate_up.chunk(2, dim=-1)
    per_expert = torch.einsum("tei,ehi->teh", F.silu(gate) * up, w2)
    combine = torch.zeros(topk_ids.shape[0], w13.shape[0]).scatter_add_(1, topk_ids, topk_weights.float())
    return torch.einsum("teh,te->th", per_expert, combine)


ROUTING = [
    pytest.param(1, 1, id="T1-k1"),
    pytest.param(1, 2, id="T1-k2"),
    pytest.param(7, 2, id="T7-k2"),
    pytest.param(40, 1, id="T40-k1"),
    pytest.param(40, 2, id="T40-k2"),
]


@pytest.mark.parametrize(("num_tokens", "top_k"), ROUTING)
def test_reference_matches_dense_formula(num_tokens, top_k):
    case = make_moe_case(num_tokens, 32, 48, num_experts=6, top_k=top_k, num_idle=2, seed=num_tokens)
    args = (case.hidden, case.w13, case.w2, case.topk_weights, case.topk_ids)
    torch.testing.assert_close(reference.fused_moe(*args), dense_moe(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_tokens", "top_k"), ROUTING)
def test_cpu_grouped_path_matches_reference(num_tokens, top_k, dtype):
    case = make_moe_case(num_tokens, 32, 48, num_experts=6, top_k=top_k, dtype=dtype, num_idle=2, seed=1)
    args = (case.hidden, case.w13, case.w2, case.topk_weights, case.topk_ids)
    actual, expected = cpu.fused_moe(*args), reference.fused_moe(*args)
    assert actual.dtype == expected.dtype == dtype and actual.shape == case.hidden.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


def test_no_tokens():
    case = make_moe_case(0, 32, 48, num_experts=4, top_k=2)
    args = (case.hidden, case.w13, case.w2, case.topk_weights, case.topk_ids)
    assert cpu.fused_moe(*args).shape == reference.fused_moe(*args).shape == (0, 32)


@pytest.mark.heavy
def test_triton_kernel_under_the_interpreter():
    """test_fused_moe_triton.py in a child pytest with TRITON_INTERPRET=1 (the mode is fixed per process
    when triton is first imported; see tests/kernels/conftest.py)."""
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TRITON_CASES)],
        cwd=TRITON_CASES.parents[2],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0 and " passed" in result.stdout, (
        f"interpreter cases failed:\n{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    )
