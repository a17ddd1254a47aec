"""Qwen2 / Qwen2.5: the Llama decoder with q/k/v biases (no o_proj bias).

Sliding-window layers are those the config's ``layer_types`` names (Transformers derives them from
``use_sliding_window`` and ``max_window_layers``).
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.models.causal_lm import DecoderForCausalLM
from pagedserve.server.models.spec import DecoderSpec, llama_spec_fields


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        fields = llama_spec_fields(hf_config)
        fields.update(qkv_bias=True, o_bias=False, mlp_bias=False)
        if not getattr(hf_config, "use_sliding_window", False):
            fields["sliding_window"] = None
        return DecoderSpec(**fields)
