"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder whose checkpoints ship ``qkv_proj`` and ``gate_up_proj``
already fused (loaded as they are), with LongRoPE (``longrope``, formerly ``su``) short and long factors
and an optional ``partial_rotary_factor`` (server/layers/rotary.py). ``sliding_window``, when set, applies
to every layer, as in Transformers' Phi3Model."""

from __future__ import annotations

from typing import Any

from pagedserve.server.models.causal_lm import DecoderForCausalLM
from pagedserve.server.models.spec import FULL_ATTENTION, SLIDING_ATTENTION, DecoderSpec, llama_spec_fields


class Phi3ForCausalLM(DecoderForCausalLM):
    stacked_params = ()

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        fields = llama_spec_fields(hf_config)
        fields.update(qkv_bias=False, o_bias=False, mlp_bias=False)
        layer_type = FULL_ATTENTION if fields["sliding_window"] is None else SLIDING_ATTENTION
        fields["layer_types"] = [layer_type] * fields["num_layers"]
        return DecoderSpec(**fields)
