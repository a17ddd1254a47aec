"""The Triton fused_moe kernel against the reference: in Triton's CPU interpreter (test_fused_moe.py runs
this file in a child process with TRITON_INTERPRET=1) or on a CUDA device; skipped otherwise."""

import importlib

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels._triton_utils import interpreter_active

if not (interpreter_active() or torch.cuda.is_available()):
    pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1) or CUDA", allow_module_level=True)

import pagedserve.kernels as kernels
from pagedserve.kernels import reference

from pagedserve.testing.kernels import make_moe_case

# The module, not the function of the same name that pagedserve.kernels exports.
fused_moe_module = importlib.import_module("pagedserve.kernels.fused_moe")
DEVICE = "cpu" if interpreter_active() else "cuda"


def check(num_tokens, top_k, block_m, num_experts=5, num_idle=2, hidden=32, intermediate=48, seed=0):
    case = make_moe_case(
        num_tokens, hidden, intermediate, num_experts, top_k, device=DEVICE, num_idle=num_idle, seed=seed
    )
    assert not bool(torch.isin(case.topk_ids, torch.tensor(case.idle_experts, device=DEVICE)).any())
    args = (case.hidden, case.w13, case.w2, case.topk_weights, case.topk_ids)
    actual = fused_moe_module._fused_moe(*args, block_m)
    expected = reference.fused_moe(*args)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert (actual - expected).abs().max().item() <= 1e-4


# T=1 (decode), T*k not a multiple of the row tile, k=1 and 2; two experts always idle.
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 5, 21])
def test_matches_reference(num_tokens, top_k):
    check(num_tokens, top_k, block_m=16, seed=num_tokens)


def test_several_tiles_per_expert_and_odd_sizes():
    """Experts with more rows than one tile, K and N not multiples of the column blocks."""
    check(40, 2, block_m=16, num_experts=3, num_idle=1, hidden=40, intermediate=24, seed=7)


def test_public_entry_point_picks_a_tile_and_splits_long_batches(monkeypatch):
    monkeypatch.setattr(fused_moe_module, "MAX_TOKENS_PER_PASS", 2)  # 3 tokens: two passes
    case = make_moe_case(3, 32, 48, 4, 2, device=DEVICE)
    args = (case.hidden, case.w13, case.w2, case.topk_weights, case.topk_ids)
    assert (kernels.fused_moe(*args) - reference.fused_moe(*args)).abs().max().item() <= 1e-4


def test_alignment_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    alignment = fused_moe_module.align_by_expert(ids, num_experts=5, block_m=4)
    padded_len = int(alignment.padded_len)
    assert padded_len == 12  # experts 0, 2 and 3: one tile each; 1 and 4 none
    rows = alignment.sorted_rows[:padded_len].view(3, 4).tolist()
    assert rows == [[1, 4, 6, 6], [0, 2, 5, 6], [3, 6, 6, 6]]  # flat token * k + slot; 6 pads
    assert alignment.tile_experts[:3].tolist() == [0, 2, 3]


def test_moe_layer_on_the_triton_backend():
    """The layer (router, top-k, shared expert) with Triton's kernels equals it with the references."""
    from pagedserve.server.layers.fused_moe import FusedMoE, MoESpec
    from pagedserve.server.layers.linear import Linear

    spec = MoESpec(6, 2, 32, renormalize=False, sparse_layers=frozenset({0}), shared_expert_size=48,
                   shared_expert_gate=True)  # fmt: skip
    device = torch.device(DEVICE)
    f32 = torch.float32
    # Any module serves as the shared expert; a projection keeps the test about the routed path.
    layers = [
        FusedMoE(spec, 32, Linear(32, 32, False, f32, device), backend, f32, device)
        for backend in (kernels, reference)
    ]
    generator = torch.Generator().manual_seed(3)
    for triton_param, reference_param in zip(layers[0].parameters(), layers[1].parameters(), strict=True):
        triton_param.copy_(torch.randn(triton_param.shape, generator=generator) * 0.3)
        reference_param.copy_(triton_param)
    x = torch.randn(9, 32, generator=generator).to(device)
    with torch.inference_mode():
        assert (layers[0](x) - layers[1](x)).abs().max().item() <= 1e-4


CUDA_ONLY = pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tl.dot and CUDA graphs need a GPU")


@CUDA_ONLY
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_bfloat16_at_model_sizes(num_tokens):
    """Mixtral's routing (8 experts, top 2) at a quarter of its widths, decode to prefill sizes."""
    case = make_moe_case(num_tokens, 1024, 896, 8, 2, dtype=torch.bfloat16, device=DEVICE, seed=num_tokens)
    args = (case.hidden, case.w13, case.w2, case.topk_weights, case.topk_ids)
    actual, expected = kernels.fused_moe(*args), reference.fused_moe(*args)
    assert actual.dtype == torch.bfloat16
    assert (actual.float() - expected.float()).abs().max().item() <= 5e-2


@CUDA_ONLY
def test_replays_in_a_cuda_graph_with_new_routing():
    """No host synchronisation: captured once, the graph follows routing it was not captured with."""
    case = make_moe_case(4, 64, 96, 6, 2, device=DEVICE, num_idle=0)
    hidden, ids, weights = case.hidden.clone(), case.topk_ids.clone(), case.topk_weights.clone()
    kernels.fused_moe(hidden, case.w13, case.w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.fused_moe(hidden, case.w13, case.w2, weights, ids)
    other = make_moe_case(4, 64, 96, 6, 2, device=DEVICE, num_idle=3, seed=9)
    hidden.copy_(other.hidden)
    ids.copy_(other.topk_ids)
    weights.copy_(other.topk_weights)
    graph.replay()
    expected = reference.fused_moe(hidden, case.w13, case.w2, weights, ids)
    assert (out - expected).abs().max().item() <= 1e-4
