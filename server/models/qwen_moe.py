"""Qwen2-MoE and Qwen3-MoE: the Qwen decoders with mixture-of-experts MLPs.

Which layers have experts: all but ``mlp_only_layers``, every ``decoder_sparse_step``-th (the others keep
a dense MLP of ``intermediate_size``). Experts are ``moe_intermediate_size`` wide; top-k weights are
renormalised when ``norm_topk_prob`` says. Qwen2-MoE adds a shared expert on every token, scaled by
``sigmoid(shared_expert_gate(x))``; Qwen3-MoE has none, and is Qwen3's decoder (q/k norm per head).
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.layers.fused_moe import MoESpec
from pagedserve.server.models.moe import MoEMixin
from pagedserve.server.models.qwen2 import Qwen2ForCausalLM
from pagedserve.server.models.qwen3 import Qwen3ForCausalLM
from pagedserve.server.models.spec import SLIDING_ATTENTION, DecoderSpec


def qwen_moe_spec(hf_config: Any, num_layers: int, shared_expert_size: int = 0) -> MoESpec:
    dense_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    sparse = [
        i for i in range(num_layers)
        if i not in dense_only and hf_config.num_experts > 0 and (i + 1) % step == 0
    ]  # fmt: skip
    return MoESpec(
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        renormalize=bool(hf_config.norm_topk_prob),
        sparse_layers=frozenset(sparse),
        shared_expert_size=shared_expert_size,
        shared_expert_gate=shared_expert_size > 0,
    )


class Qwen2MoeForCausalLM(MoEMixin, Qwen2ForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        spec = super().spec_from_config(hf_config)
        spec.qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
        return spec

    @classmethod
    def moe_spec(cls, hf_config: Any, num_layers: int) -> MoESpec:
        return qwen_moe_spec(hf_config, num_layers, hf_config.shared_expert_intermediate_size or 0)


class Qwen3MoeForCausalLM(MoEMixin, Qwen3ForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        spec = super().spec_from_config(hf_config)
        # Qwen3-MoE configs have no layer_types: Transformers applies the window, if any, to every layer.
        if spec.sliding_window is not None and not getattr(hf_config, "layer_types", None):
            spec.layer_types = [SLIDING_ATTENTION] * spec.num_layers
        return spec

    @classmethod
    def moe_spec(cls, hf_config: Any, num_layers: int) -> MoESpec:
        return qwen_moe_spec(hf_config, num_layers)
