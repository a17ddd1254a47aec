"""Mixtral, Qwen2-MoE and Qwen3-MoE against HF Transformers on tiny seeded random checkpoints.

Through the engine with the shared parity check (tests/models/parity.py: batched prompts, chunked
prefill, prefix-cache hits; greedy tokens equal, logprobs close) on the torch backend (the per-expert
loop of kernels/reference.py) and the cpu backend (its grouped path, kernels/cpu.py). Through the paged
schedule of tests/models/test_models.py every logit row is compared too, for checkpoints written by
``save_pretrained`` (per-expert names) and for a Transformers 5 model's in-memory state dict (stacked
``experts.gate_up_proj``). The Triton kernel runs in tests/kernels/test_fused_moe_triton.py.
"""

from __future__ import annotations

import pytest
import torch
from pagedserve.server.layers.fused_moe import FusedMoE
from pagedserve.server.loader import load_model
from pagedserve.server.models.decoder import GatedMLP
from pagedserve.server.models.registry import build_model
from parity import BACKENDS, TINY, assert_greedy_parity, checkpoint_fixture, random_hf_model
from test_models import assert_matches_hf, backend_on_cpu, random_prompts
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(cls, architecture: str, **fields):
    shape = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config = cls(**{**TINY, **shape, **fields})
    config.architectures = [architecture]
    return config


# One config per family, with each family's quirks switched on; few tokens per step leave experts idle.
CASES = {
    # 6 experts, top-2, weights renormalised.
    "mixtral": lambda: _config(
        MixtralConfig, "MixtralForCausalLM", intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
    ),
    # A gated shared expert, layer 1 dense (mlp_only_layers), top-1 routing, weights not renormalised.
    "qwen2-moe": lambda: _config(
        Qwen2MoeConfig, "Qwen2MoeForCausalLM", intermediate_size=80, num_experts=5, num_experts_per_tok=1,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # q/k norm per head, head_dim apart from hidden/heads, top-2 renormalised, every 2nd layer sparse.
    "qwen3-moe": lambda: _config(
        Qwen3MoeConfig, "Qwen3MoeForCausalLM", intermediate_size=80, head_dim=32, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
    ),
}  # fmt: skip


moe_family = checkpoint_fixture(CASES, "moe_family")


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_matches_hf(moe_family, backend):
    _, hf, path = moe_family
    assert_greedy_parity(hf, path, backend)


def test_every_logit_row_matches_hf(moe_family):
    _, hf, path = moe_family
    ours, config = load_model(path, "float32", "cpu", backend=backend_on_cpu())
    assert type(ours).__name__ == config.architectures[0]
    assert any(isinstance(layer.mlp, FusedMoE) for layer in ours.model.layers)
    assert_matches_hf(hf, ours, random_prompts(config.vocab_size), atol=1e-4)


def test_transformers_stacked_expert_names_load(moe_family):
    """Transformers 5 keeps every layer's experts in one tensor in memory (``save_pretrained`` splits them
    per expert): those names load too."""
    _, hf, _ = moe_family
    assert any(name.endswith("experts.gate_up_proj") for name in hf.state_dict())
    ours = build_model(hf.config, torch.float32, "cpu", backend_on_cpu("torch"))
    ours.load_weights(hf.state_dict().items())
    assert_matches_hf(hf, ours, random_prompts(hf.config.vocab_size, seed=1), atol=1e-4)


def test_sparse_and_dense_layers_follow_the_config():
    qwen2 = build_model(CASES["qwen2-moe"](), torch.float32, "cpu", backend_on_cpu())
    mlps = [layer.mlp for layer in qwen2.model.layers]
    assert [type(m) for m in mlps] == [FusedMoE, GatedMLP, FusedMoE]  # mlp_only_layers=[1]
    assert mlps[0].shared_expert.down_proj.weight.shape == (64, 48)
    assert mlps[0].shared_expert_gate.weight.shape == (1, 64)
    assert mlps[1].down_proj.weight.shape == (64, 80)  # the dense layer: intermediate_size
    assert mlps[0].experts.w13_weight.shape == (5, 2 * 32, 64)
    assert mlps[0].experts.w2_weight.shape == (5, 64, 32)
    qwen3 = build_model(CASES["qwen3-moe"](), torch.float32, "cpu", backend_on_cpu())
    assert [type(layer.mlp) for layer in qwen3.model.layers] == [GatedMLP, FusedMoE, GatedMLP]  # step 2
    assert qwen3.model.layers[1].mlp.shared_expert is None
    assert qwen3.model.layers[0].self_attn.qk_norm == "head"


def test_missing_or_unknown_expert_weights_are_named():
    hf = random_hf_model(CASES["mixtral"]())  # one family: the loading code is shared
    state = dict(hf.state_dict())
    gate_up = state.pop("model.layers.2.mlp.experts.gate_up_proj")
    ours = build_model(hf.config, torch.float32, "cpu", backend_on_cpu())
    with pytest.raises(ValueError, match=r"lacks 12 weights: .*layers\.2\.mlp\.experts\.0\.gate_proj"):
        ours.load_weights(state.items())
    extra = {**state, "model.layers.2.mlp.experts.gate_up_proj": gate_up,
             "model.layers.0.block_sparse_moe.experts.6.w1.weight": gate_up[0, :48]}  # fmt: skip
    with pytest.raises(ValueError, match=r"experts\.6\.w1\.weight.*not slab 12"):
        ours.load_weights(extra.items())
