"""Mixtral: Mistral's decoder with every MLP a mixture of experts (top-k renormalised, no shared expert).

Checkpoints name the MoE ``block_sparse_moe`` and the experts' projections ``w1`` (gate), ``w3`` (up) and
``w2`` (down); they are renamed to the Qwen / Transformers 5 names the MoE layer loads.
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.layers.fused_moe import MoESpec
from pagedserve.server.models.llama import MistralForCausalLM
from pagedserve.server.models.moe import MoEMixin


class MixtralForCausalLM(MoEMixin, MistralForCausalLM):
    checkpoint_renames = (
        ("block_sparse_moe.", "mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )

    @classmethod
    def moe_spec(cls, hf_config: Any, num_layers: int) -> MoESpec:
        return MoESpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
            sparse_layers=frozenset(range(num_layers)),
        )
