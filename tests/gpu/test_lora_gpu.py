"""The Triton LoRA shrink/expand (kernels/lora.py) compiled for CUDA against the references (fp32, fp16 and
bf16: the interpreter cannot check bf16), at the embedded model's and Llama-3-8B's projection shapes with
merged-projection ranks; and both captured in a CUDA graph and replayed with other slots, which they
must follow without a host read."""

import pytest
import torch
from pagedserve.kernels import lora, reference

from pagedserve.testing.gpu import GPU
from pagedserve.testing.kernels import make_lora_case

pytestmark = GPU

# (atol, rtol) against the fp32 reference on the same inputs, atol scaled by the output's magnitude:
# bf16/fp16 outputs are rounded once; expand multiplies in tf32 for those.
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOLERANCE]
# (in, out): SmolLM2-135M's qkv, gate_up, down; Llama-3-8B's qkv and down.
SHAPES = [(576, 960), (576, 3072), (1536, 576), (4096, 6144), (14336, 4096)]


def mixed_slots(num_tokens: int, num_slots: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, num_slots, (num_tokens,), generator=gen).tolist()


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * scale, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [16, 192])  # one slice of rank 16; q/k/v of rank 64 stacked
@pytest.mark.parametrize(("num_tokens", "num_slots"), [(1, 1), (7, 4), (64, 4), (300, 8), (2048, 2)])
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_lora_kernels_match_reference(in_features, out_features, num_tokens, num_slots, rank, dtype):
    slots = mixed_slots(num_tokens, num_slots, seed=num_tokens)
    case = make_lora_case(slots, num_slots, rank, in_features, out_features, dtype=dtype, device="cuda")
    expected_buf = reference.lora_shrink(case.x, case.lora_a, case.token_slots)
    buf = lora.lora_shrink(case.x, case.lora_a, case.token_slots)
    assert buf.dtype == torch.float32
    assert_close_scaled(buf, expected_buf, dtype)
    base = case.token_slots < 0
    assert not buf[base].any()
    expected_y = reference.lora_expand(case.y.clone(), expected_buf, case.lora_b, case.token_slots)
    before = case.y.clone()
    assert lora.lora_expand(case.y, expected_buf, case.lora_b, case.token_slots) is case.y
    assert_close_scaled(case.y, expected_y, dtype)
    assert torch.equal(case.y[base], before[base])


def test_lora_kernels_replay_in_a_cuda_graph():
    """Captured once with one assignment of slots, replayed with others written into the same tensor: the
    grouping is computed on the device inside the graph, so every replay follows its own slots."""
    num_tokens, num_slots, rank, in_features, out_features = 32, 4, 16, 576, 960
    case = make_lora_case(
        mixed_slots(num_tokens, num_slots, 0), num_slots, rank, in_features, out_features,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    y = case.y.clone()

    def step() -> None:
        buf = lora.lora_shrink(case.x, case.lora_a, case.token_slots)
        lora.lora_expand(y, buf, case.lora_b, case.token_slots)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph: compiles the kernels
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        slots = torch.tensor(mixed_slots(num_tokens, num_slots, seed), device="cuda")
        case.token_slots.copy_(slots)
        y.copy_(case.y)
        graph.replay()
        buf = reference.lora_shrink(case.x, case.lora_a, slots)
        expected = reference.lora_expand(case.y.clone(), buf, case.lora_b, slots)
        assert_close_scaled(y, expected, torch.bfloat16)
