"""The Triton kernels on an FP8 KV cache against the torch reference, in Triton's CPU interpreter.

The cases run only in a process that interprets Triton; a normal run gets there through
``test_fp8_kv_triton_under_the_interpreter``, which runs this file in a child pytest with
``TRITON_INTERPRET=1`` (the mode is per process: tests/kernels/conftest.py).

Acceptance: the store writes the reference's bytes exactly. Attention: max abs error against the
reference's FP8 path <= 1e-3 in fp32 and <= 2e-2 in fp16 (test_triton_kernels.py's bounds: the kernels
do the same arithmetic with the scales moved out of the loop), and against the unquantized cache within
test_fp8_kv.py's QUANTIZATION_ATOL. Small shapes: the interpreter is slow.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

import torch
from pagedserve.kernels import reference
from pagedserve.kernels._triton_utils import interpreter_active

from pagedserve.testing.kernels import contexts, fp8_paged_case, hide_blocks_outside_window, make_paged_case

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2}
QUANTIZATION_ATOL = 0.16  # test_fp8_kv.py: the FP8 cache against the fp32 one it was made from
K_SCALE, V_SCALE = 0.05, 0.02
interpreted = pytest.mark.skipif(not interpreter_active(), reason="runs in the interpreter's child pytest")


@pytest.mark.skipif(interpreter_active(), reason="this process interprets Triton: the cases ran directly")
@pytest.mark.heavy
def test_fp8_kv_triton_under_the_interpreter():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=Path(__file__).parents[2],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = f"{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == 0, f"interpreter cases failed:\n{output}"
    assert " passed" in result.stdout.splitlines()[-1]  # the cases ran, not only skipped


def triton_module(name: str):
    return importlib.import_module(f"pagedserve.kernels.{name}")


def error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    return (actual.float() - expected.float()).abs().max().item()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_store_writes_the_reference_bytes(dtype):
    # Every finite e4m3 value and the midpoints between neighbours (ties), times the scale; saturation
    # past 448; -0.0; values below e4m3's smallest subnormal; negative slots write nothing.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].sort().values
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([500.0, -1e4, -0.0, 1e-4, -1e-4])])
    x = torch.cat([x, torch.randn(64 - x.numel() % 64, generator=torch.Generator().manual_seed(0)) * 100])
    x = x.view(-1, 2, 32)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    k, v = (x * K_SCALE).to(dtype), (x.flip(0) * V_SCALE).to(dtype)
    num_slots = x.shape[0] + 8  # some slots stay empty
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(0))[: x.shape[0]]
    slots[3] = -1
    scales = torch.tensor([K_SCALE]), torch.tensor([V_SCALE])
    caches = [torch.zeros(-(-num_slots // 4), 4, 2, 32, dtype=FP8) for _ in range(4)]
    reference.store_kv_cache(k, v, caches[0], caches[1], slots, *scales)
    triton_module("store_kv_cache").store_kv_cache(k, v, caches[2], caches[3], slots, *scales)
    assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))


ATTENTION = [
    pytest.param(torch.float32, 1, 64, 16, None, None, id="fp32-gqa1-d64-bs16"),
    pytest.param(torch.float16, 3, 64, 32, None, None, id="fp16-gqa3-d64-bs32"),
    pytest.param(torch.float32, 3, 64, 16, 20, None, id="fp32-window20"),
    pytest.param(torch.float32, 1, 64, 16, None, 2.5, id="fp32-softcap"),
    pytest.param(torch.float32, 3, 64, 16, 37, 3.0, id="fp32-window-softcap"),
]


def fp8_case(dtype, group, head_dim, block_size, sliding_window, q_lens=None):
    case = make_paged_case(contexts(block_size), 2 * group, 2, head_dim, block_size, dtype, q_lens=q_lens)
    if sliding_window is not None:  # blocks before every window hold NaN: a kernel must not read them
        case = hide_blocks_outside_window(case, sliding_window, q_lens)
    return (case, *fp8_paged_case(case, K_SCALE, V_SCALE))


@interpreted
@pytest.mark.parametrize(("dtype", "group", "head_dim", "block_size", "sliding_window", "logit_softcap"),
                         ATTENTION)
def test_decode(dtype, group, head_dim, block_size, sliding_window, logit_softcap):
    case, fp8, k_scale, v_scale = fp8_case(dtype, group, head_dim, block_size, sliding_window)
    common = (case.block_tables, case.context_lens, head_dim**-0.5)
    variant = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    fp8_args = (case.q_decode, fp8.k_cache, fp8.v_cache, *common)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    expected = reference.paged_attention_decode(*fp8_args, **variant, **scales)
    module = triton_module("paged_attention_decode")
    assert error(module.paged_attention_decode(*fp8_args, **variant, **scales), expected) <= TOLERANCE[dtype]
    # Split-K: the partials are scaled before the merge.
    split = module._decode(*fp8_args, num_splits=4, partition=block_size + 8, **variant, **scales)
    assert error(split, expected) <= TOLERANCE[dtype]
    unquantized = reference.paged_attention_decode(
        case.q_decode, case.k_cache, case.v_cache, *common, **variant
    )
    assert error(split, unquantized) <= QUANTIZATION_ATOL


@interpreted
@pytest.mark.parametrize(("dtype", "group", "head_dim", "block_size", "sliding_window", "logit_softcap"),
                         ATTENTION)
def test_prefill(dtype, group, head_dim, block_size, sliding_window, logit_softcap, monkeypatch):
    module = triton_module("paged_attention_prefill")
    monkeypatch.setattr(module, "BLOCK_M", 32)  # small tiles: the interpreter's tl.dot is slow
    monkeypatch.setattr(module, "BLOCK_N", 32)
    q_lens = [1, 2 * block_size, 7, 1, 7]
    case, fp8, k_scale, v_scale = fp8_case(dtype, group, head_dim, block_size, sliding_window, q_lens)
    common = (case.block_tables, case.cu_seqlens_q, case.context_lens, head_dim**-0.5)
    variant = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    fp8_args = (case.q_prefill, fp8.k_cache, fp8.v_cache, *common)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = module.paged_attention_prefill(*fp8_args, **variant, **scales)
    assert error(out, reference.paged_attention_prefill(*fp8_args, **variant, **scales)) <= TOLERANCE[dtype]
    unquantized = reference.paged_attention_prefill(case.q_prefill, case.k_cache, case.v_cache, *common,
                                                    **variant)
    assert error(out, unquantized) <= QUANTIZATION_ATOL


@interpreted
def test_missing_scales_are_one():
    case, fp8, _, _ = fp8_case(torch.float32, 1, 64, 16, None)
    fp8_args = (case.q_decode, fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens, 0.125)
    expected = reference.paged_attention_decode(*fp8_args)
    actual = triton_module("paged_attention_decode").paged_attention_decode(*fp8_args)
    assert error(actual, expected) <= TOLERANCE[torch.float32]
