"""Qwen3: the Qwen2 decoder with an RMSNorm on every q and k head before the rotation, and biases as the
config's ``attention_bias`` says (q/k/v and o alike)."""

from __future__ import annotations

from typing import Any

from pagedserve.server.models.causal_lm import DecoderForCausalLM
from pagedserve.server.models.spec import DecoderSpec, llama_spec_fields


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        fields = llama_spec_fields(hf_config)
        if not getattr(hf_config, "use_sliding_window", False):
            fields["sliding_window"] = None
        return DecoderSpec(**fields, qk_norm="head")
