"""Llama (1 to 3.x, SmolLM and most Llama-architecture fine-tunes) and Mistral: the plain pre-norm decoder."""

from __future__ import annotations

from typing import Any

from pagedserve.server.models.causal_lm import DecoderForCausalLM
from pagedserve.server.models.spec import FULL_ATTENTION, SLIDING_ATTENTION, DecoderSpec, llama_spec_fields


class LlamaForCausalLM(DecoderForCausalLM):
    """Biases as the config's ``attention_bias`` / ``mlp_bias`` say; full attention in every layer."""

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        fields = llama_spec_fields(hf_config)
        fields["layer_types"], fields["sliding_window"] = [], None
        return DecoderSpec(**fields)


class MistralForCausalLM(DecoderForCausalLM):
    """No biases; every layer attends within ``sliding_window`` when the config sets one."""

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        fields = llama_spec_fields(hf_config)
        fields.update(qkv_bias=False, o_bias=False, mlp_bias=False)
        layer_type = FULL_ATTENTION if fields["sliding_window"] is None else SLIDING_ATTENTION
        fields["layer_types"] = [layer_type] * fields["num_layers"]
        return DecoderSpec(**fields)
