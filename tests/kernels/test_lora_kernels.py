"""Batched LoRA shrink/expand: the CPU backend's grouped path (kernels/cpu.py) and the Triton kernels
(kernels/lora.py) against the references (kernels/reference.py, "LoRA").

The Triton cases (``test_triton_*``) run in Triton's CPU interpreter: in this process when the whole run
was started with ``TRITON_INTERPRET=1``, else in a child pytest that has it set from the start
(``test_triton_cases_under_the_interpreter``; the mode is fixed per process, see tests/kernels/conftest.py).
bf16 only on a GPU (tests/gpu/test_lora_gpu.py): the interpreter computes bf16 ``tl.dot`` wrongly.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagedserve.kernels import cpu, reference
from torch.utils._python_dispatch import TorchDispatchMode

from pagedserve.testing.kernels import make_lora_case

try:  # Triton ships with torch on Linux x86-64 only; the CPU backend's cases run everywhere
    from pagedserve.kernels._triton_utils import interpreter_active

    INTERPRETING, HAS_TRITON = interpreter_active(), True
except ImportError:
    INTERPRETING, HAS_TRITON = False, False

interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="run in a child with TRITON_INTERPRET=1")

# Token counts: one (decode), a partial tile, more than two 16-token tiles.
NUM_TOKENS = [1, 5, 37]
PATTERNS = ["mixed", "all_base", "one_slot", "one_slot_and_base", "descending", "runs"]
# (atol, rtol) of the shrink and of the updated y against the reference on the same inputs.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def slot_pattern(name: str, num_tokens: int, num_slots: int) -> list[int]:
    """Slots per token: random with base tokens (-1) among them, none but base tokens, all one slot, one
    slot and base tokens alternating, slots in descending order round after round, and the runner's
    order (server/worker/model_runner.py): decodes, then prefills, each sorted by adapter."""
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_slots)
    last = num_slots - 1
    half = num_tokens // 2

    def runs() -> list[int]:
        drawn = torch.randint(-1, num_slots, (num_tokens,), generator=gen).tolist()
        return sorted(drawn[:half]) + sorted(drawn[half:])

    return {
        "mixed": lambda: torch.randint(-1, num_slots, (num_tokens,), generator=gen).tolist(),
        "all_base": lambda: [-1] * num_tokens,
        "one_slot": lambda: [last] * num_tokens,
        "one_slot_and_base": lambda: [last if t % 2 else -1 for t in range(num_tokens)],
        "descending": lambda: [last - t % num_slots for t in range(num_tokens)],
        "runs": runs,
    }[name]()


def check_shrink(shrink, num_tokens, num_slots, rank, pattern, dtype, in_features=96):
    slots = slot_pattern(pattern, num_tokens, num_slots)
    case = make_lora_case(slots, num_slots, rank, in_features, 40, dtype=dtype, seed=num_tokens + rank)
    expected = reference.lora_shrink(case.x, case.lora_a, case.token_slots)
    actual = shrink(case.x, case.lora_a, case.token_slots)
    assert actual.shape == (num_tokens, rank) and actual.dtype == torch.float32
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    assert not actual[case.token_slots < 0].any(), "a base-model token's shrink row is not zero"


def check_expand(expand, num_tokens, num_slots, rank, pattern, dtype, out_features=80, y_offset=0):
    """``y`` is a column slice of a wider tensor when ``y_offset`` > 0 (rows not contiguous)."""
    slots = slot_pattern(pattern, num_tokens, num_slots)
    case = make_lora_case(slots, num_slots, rank, 32, out_features, dtype=dtype, seed=num_tokens * rank)
    buf = reference.lora_shrink(case.x, case.lora_a, case.token_slots)
    wide = torch.randn(num_tokens, out_features + 2 * y_offset, generator=torch.Generator().manual_seed(1))
    wide = wide.to(dtype)
    y = wide[:, y_offset:y_offset + out_features]
    y.copy_(case.y)
    before = wide.clone()
    expected = reference.lora_expand(case.y.clone(), buf, case.lora_b, case.token_slots)
    actual = expand(y, buf, case.lora_b, case.token_slots)
    assert actual is y, "lora_expand must return the y it was given, updated in place"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(y, expected, atol=atol, rtol=rtol)
    base = case.token_slots < 0
    assert torch.equal(wide[base].view(torch.uint8), before[base].view(torch.uint8)), "a base row changed"
    outside = torch.ones(wide.shape[1], dtype=torch.bool)
    outside[y_offset:y_offset + out_features] = False
    assert torch.equal(wide[:, outside], before[:, outside]), "columns outside y were written"


CHECKS = {"shrink": check_shrink, "expand": check_expand}


def on_the_grid(*dtypes: torch.dtype):
    """The cases every implementation is checked on: shrink and expand, each token count, slot pattern,
    (slots, rank) and the given dtypes."""
    marks = [
        pytest.mark.parametrize("dtype", dtypes, ids=[str(d).removeprefix("torch.") for d in dtypes]),
        pytest.mark.parametrize("pattern", PATTERNS),
        pytest.mark.parametrize(("num_slots", "rank"), [(1, 8), (3, 16), (4, 48)]),
        pytest.mark.parametrize("num_tokens", NUM_TOKENS),
        pytest.mark.parametrize("op", list(CHECKS)),
    ]

    def apply(test):
        for mark in marks:
            test = mark(test)
        return test

    return apply


# ---- CPU backend ---------------------------------------------------------------------------------------


@on_the_grid(torch.float32, torch.bfloat16)
def test_cpu_matches_reference(op, num_tokens, num_slots, rank, pattern, dtype):
    CHECKS[op](getattr(cpu, f"lora_{op}"), num_tokens, num_slots, rank, pattern, dtype)


@pytest.mark.parametrize("pattern", ["mixed", "one_slot"])
def test_cpu_expand_into_a_column_slice(pattern):
    check_expand(cpu.lora_expand, 37, 3, 16, pattern, torch.float32, y_offset=7)


class OpRecorder(TorchDispatchMode):
    """Every ATen op that runs inside it, and the element count of each op's tensor outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, tuple | list) else (out,)
        numel = max((t.numel() for t in outputs if isinstance(t, torch.Tensor)), default=0)
        self.ops.append((func.overloadpacket.__name__, numel))
        return out


@pytest.mark.parametrize("pattern", ["mixed", "one_slot", "runs"])
def test_cpu_path_copies_no_weights_per_token(pattern):
    """The point of the CPU path: no ``[T, R, in]`` / ``[T, out, R]`` weight gather as in the reference
    (no op output anywhere near that size), and none of the token gathers or scatters either when each
    slot's tokens are in runs (the runner's order), one slot having every token included."""
    num_tokens, rank, in_features, out_features = 37, 16, 96, 80
    case = make_lora_case(slot_pattern(pattern, num_tokens, 3), 3, rank, in_features, out_features)
    with OpRecorder() as recorder:
        buf = cpu.lora_shrink(case.x, case.lora_a, case.token_slots)
        cpu.lora_expand(case.y, buf, case.lora_b, case.token_slots)
    largest = max(numel for _, numel in recorder.ops)
    assert largest <= num_tokens * max(in_features, out_features), recorder.ops
    gathers = {"index_select", "index", "index_copy_", "index_add_", "gather", "scatter"}
    names = {name for name, _ in recorder.ops}
    assert bool(names & gathers) == (pattern == "mixed"), names
    assert names & {"mm", "addmm"}, names  # the runs' products ran, not nothing


def test_cpu_grouping_is_redone_when_the_slots_change_in_place():
    """The CPU path groups a step's slots once and reuses that while they are the same (every projection
    of a step reads one tensor); a tensor written in place since must be grouped again."""
    case = make_lora_case(slot_pattern("runs", 37, 3), 3, 16, 96, 80)
    cpu.lora_shrink(case.x, case.lora_a, case.token_slots)
    case.token_slots.copy_(torch.tensor(slot_pattern("mixed", 37, 3)))
    expected = reference.lora_shrink(case.x, case.lora_a, case.token_slots)
    torch.testing.assert_close(cpu.lora_shrink(case.x, case.lora_a, case.token_slots), expected)


def test_cpu_no_tokens():
    case = make_lora_case([], 2, 8, 32, 40)
    assert cpu.lora_shrink(case.x, case.lora_a, case.token_slots).shape == (0, 8)
    buf = torch.zeros(0, 8)
    assert cpu.lora_expand(case.y, buf, case.lora_b, case.token_slots) is case.y


# ---- Triton ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_group_by_slot_sorts_tokens_and_puts_base_tokens_last():
    from pagedserve.kernels.lora import group_by_slot

    grouping = group_by_slot(torch.tensor([2, -1, 0, 2, -1, 0, 0]), num_slots=4)
    assert grouping.sorted_tokens.tolist() == [2, 5, 6, 0, 3, 1, 4]
    assert grouping.slot_counts.tolist() == [3, 0, 2, 0]
    assert grouping.slot_starts.tolist() == [0, 3, 3, 5]


@interpreter_only
@on_the_grid(torch.float32, torch.float16)
def test_triton_matches_reference(op, num_tokens, num_slots, rank, pattern, dtype):
    from pagedserve.kernels import lora

    CHECKS[op](getattr(lora, f"lora_{op}"), num_tokens, num_slots, rank, pattern, dtype)


@interpreter_only
# Whole and split reductions (split_k 3: the splits' step counts differ), one and several token tiles
# per slot (block_m 16 with 37 tokens), a reduction with a tail (in_features 200 = 3 * 64 + 8).
@pytest.mark.parametrize(("block_m", "split_k"), [(16, 1), (16, 3), (64, 1), (64, 4)])
def test_triton_shrink_tiles_and_split_reductions(block_m, split_k):
    from pagedserve.kernels import lora

    def shrink(x, lora_a, token_slots):
        grouping = lora.group_by_slot(token_slots, lora_a.shape[0])
        return lora._shrink(x, lora_a, grouping, block_m, split_k)

    check_shrink(shrink, 37, 3, 24, "mixed", torch.float32, in_features=200)


@interpreter_only
@pytest.mark.parametrize("block_m", [16, 64])
def test_triton_expand_tiles_and_a_column_slice(block_m):
    from pagedserve.kernels import lora

    def expand(y, buf, lora_b, token_slots):
        return lora._expand(y, buf, lora_b, lora.group_by_slot(token_slots, lora_b.shape[0]), block_m)

    # rank 80: two steps of the rank reduction (BLOCK_K 64), the second partial.
    check_expand(expand, 37, 3, 80, "mixed", torch.float32, out_features=150, y_offset=5)


@interpreter_only
def test_triton_no_tokens():
    from pagedserve.kernels import lora

    case = make_lora_case([], 2, 8, 32, 40)
    assert lora.lora_shrink(case.x, case.lora_a, case.token_slots).shape == (0, 8)
    assert lora.lora_expand(case.y, torch.zeros(0, 8), case.lora_b, case.token_slots) is case.y


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.skipif(INTERPRETING, reason="this process interprets Triton: the cases ran directly")
@pytest.mark.heavy
def test_triton_cases_under_the_interpreter():
    here = Path(__file__)
    select = "triton and not under_the_interpreter"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select, str(here)],
        cwd=here.parents[2],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    failure = f"interpreter cases failed:\n{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == 0, failure
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
