"""IBM Granite (3.x): the Llama decoder with four multipliers: ``embedding_multiplier`` on the embeddings,
``attention_multiplier`` as the attention scale, ``residual_multiplier`` on each branch before the
residual add, and logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

from pagedserve.server.models.causal_lm import DecoderForCausalLM
from pagedserve.server.models.spec import DecoderSpec, llama_spec_fields


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        fields = llama_spec_fields(hf_config)
        fields.update(layer_types=[], sliding_window=None)
        return DecoderSpec(
            **fields,
            attn_scale=float(hf_config.attention_multiplier),
            embed_scale=float(hf_config.embedding_multiplier),
            residual_multiplier=float(hf_config.residual_multiplier),
            logits_scaling=float(hf_config.logits_scaling),
        )
