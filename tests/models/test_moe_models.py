"""Mixtral, Qwen2-MoE and Qwen3-MoE against HF Transformers on tiny seeded random checkpoints.

Model level: the parity schedule of tests/test_models.py (whole prompts, a chunked prompt, a late prompt,
decodes; batched through a paged cache) on checkpoints written by Transformers' ``save_pretrained`` (its
per-expert names) and on an in-memory Transformers 5 state dict (stacked ``experts.gate_up_proj``).
Engine level: ``LLM`` greedy tokens and logprobs equal HF's ``generate`` with chunked prefill and a
prefix-cache hit.
"""

from __future__ import annotations

import math

import pytest

# The parity helpers of tests/test_models.py (tests/ is on sys.path through tests/conftest.py).
import test_models
import torch
from pagedserve.server.layers.fused_moe import FusedMoE
from pagedserve.server.loader import load_model
from pagedserve.server.models.decoder import GatedMLP
from pagedserve.server.models.registry import build_model
from test_models import assert_matches_hf, backend_on_cpu, random_prompts
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, max_position_embeddings=256,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip


def moe_configs() -> dict[str, object]:
    """One config per family, with each family's quirks switched on."""
    configs = {
        # 6 experts, top-2 renormalised; few tokens per step leave some experts idle.
        "mixtral": MixtralConfig(**TINY, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2),
        # A gated shared expert, layer 1 dense (mlp_only_layers), top-1 routing, weights not renormalised.
        "qwen2-moe": Qwen2MoeConfig(
            **TINY, intermediate_size=80, num_experts=5, num_experts_per_tok=1, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
        ),
        # q/k norm per head, head_dim apart from hidden/heads, renormalised top-2, every 2nd layer sparse.
        "qwen3-moe": Qwen3MoeConfig(
            **TINY, intermediate_size=80, head_dim=32, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
        ),
    }  # fmt: skip
    architectures = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM"}  # fmt: skip
    for config in configs.values():
        config.architectures = [architectures[config.model_type]]
    return configs


def random_hf_model(config):
    # test_models.random_hf_model names the architecture from a table of the dense families; ours is set.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_models, "_with_arch", lambda config: config)
        return test_models.random_hf_model(config)


@pytest.fixture(scope="module", params=sorted(moe_configs()))
def moe_checkpoint(request, tmp_path_factory):
    hf = random_hf_model(moe_configs()[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def test_moe_models_match_hf(moe_checkpoint):
    _, hf, path = moe_checkpoint
    ours, config = load_model(path, "float32", "cpu", backend=backend_on_cpu())
    assert type(ours).__name__ == config.architectures[0]
    assert any(isinstance(layer.mlp, FusedMoE) for layer in ours.model.layers)
    assert_matches_hf(hf, ours, random_prompts(config.vocab_size), atol=1e-4)


def test_moe_models_load_transformers_stacked_experts(moe_checkpoint):
    """Transformers 5 keeps every layer's experts in one tensor in memory; those names load too, on the
    reference backend (its per-expert loop)."""
    _, hf, _ = moe_checkpoint
    assert any(name.endswith("experts.gate_up_proj") for name in hf.state_dict())
    ours = build_model(hf.config, torch.float32, "cpu", backend_on_cpu("torch"))
    ours.load_weights(hf.state_dict().items())
    assert_matches_hf(hf, ours, random_prompts(hf.config.vocab_size, seed=1), atol=1e-4)


def test_sparse_and_dense_layers_follow_the_config():
    configs = moe_configs()
    qwen2 = build_model(configs["qwen2-moe"], torch.float32, "cpu", backend_on_cpu())
    mlps = [layer.mlp for layer in qwen2.model.layers]
    assert [type(m) for m in mlps] == [FusedMoE, GatedMLP, FusedMoE]  # mlp_only_layers=[1]
    assert mlps[0].shared_expert.down_proj.weight.shape == (64, 48)
    assert mlps[0].shared_expert_gate.weight.shape == (1, 64)
    assert mlps[1].down_proj.weight.shape == (64, 80)  # the dense layer: intermediate_size
    assert mlps[0].experts.w13_weight.shape == (5, 2 * 32, 64)
    assert mlps[0].experts.w2_weight.shape == (5, 64, 32)
    qwen3 = build_model(configs["qwen3-moe"], torch.float32, "cpu", backend_on_cpu())
    types = [type(layer.mlp) for layer in qwen3.model.layers]
    assert types == [GatedMLP, FusedMoE, GatedMLP]  # decoder_sparse_step=2: layers 1, 3, ...
    assert qwen3.model.layers[1].mlp.shared_expert is None
    assert qwen3.model.layers[0].self_attn.qk_norm == "head"


def test_missing_or_unknown_expert_weights_are_named():
    hf = random_hf_model(moe_configs()["mixtral"])  # one family: the loading code is shared
    state = dict(hf.state_dict())
    gate_up = state.pop("model.layers.2.mlp.experts.gate_up_proj")
    ours = build_model(hf.config, torch.float32, "cpu", backend_on_cpu())
    with pytest.raises(ValueError, match=r"lacks 12 weights: .*layers\.2\.mlp\.experts\.0\.gate_proj"):
        ours.load_weights(state.items())
    extra = {**state, "model.layers.2.mlp.experts.gate_up_proj": gate_up,
             "model.layers.0.block_sparse_moe.experts.6.w1.weight": gate_up[0, :48]}  # fmt: skip
    with pytest.raises(ValueError, match=r"experts\.6\.w1\.weight.*not slab 12"):
        ours.load_weights(extra.items())


# --- the engine ----------------------------------------------------------------------------------

NEW_TOKENS = 8


def hf_greedy(hf, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """HF's greedy continuations and the chosen tokens' logprobs (from the raw logits: ``scores`` would have
    EOS masked by ``min_new_tokens``)."""
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
            new = out.sequences[0, len(ids):].tolist()
            tokens.append(new)
            logprobs.append(
                [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new, strict=True)]
            )
    return tokens, logprobs


def test_engine_greedy_matches_hf_with_chunked_prefill_and_prefix_cache(moe_checkpoint, default_model_path):
    """Two prompts share 40 tokens (two full blocks): the second hits the prefix cache; a 32-token budget
    chunks the 50-token prompts. Tokens are ids, so the embedded model's tokenizer only detokenizes."""
    _, hf, path = moe_checkpoint
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 256, (40,), generator=generator).tolist()
    prompts = [
        shared + torch.randint(0, 256, (10,), generator=generator).tolist(),
        torch.randint(0, 256, (7,), generator=generator).tolist(),
        shared + torch.randint(0, 256, (12,), generator=generator).tolist(),
    ]
    expected_tokens, expected_logprobs = hf_greedy(hf, prompts)
    llm = LLM(str(path), tokenizer=default_model_path, max_num_batched_tokens=32, max_model_len=128,
              enable_prefix_caching=True)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params)
    (second,) = llm.generate([{"prompt_token_ids": prompts[2]}], params)
    assert second.num_cached_tokens >= 32
    for output, tokens, logprobs in zip([*first, second], expected_tokens, expected_logprobs, strict=True):
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(ours, logprobs, strict=True)), logprobs
