"""Gemma 2 and Gemma 3 (text): sandwich norms, ``x * (1 + w)`` RMSNorms, scaled embeddings, GELU-tanh,
sliding/global attention alternating by layer, soft-capped logits.

- Both: a norm before and after attention and the MLP; embeddings times ``sqrt(hidden_size)`` rounded to
  the model dtype; attention scaled by ``query_pre_attn_scalar ** -0.5``; ``final_logit_softcapping``;
  ``layer_types`` names each layer's attention (Transformers derives it from ``sliding_window_pattern``).
- Gemma 2: ``attn_logit_softcapping`` on the attention scores.
- Gemma 3: q/k RMSNorm per head; local (sliding) layers rotate with ``rope_local_base_freq``, which
  Transformers 5 keeps as ``rope_parameters["sliding_attention"]``; no attention soft-capping (its
  attention ignores ``attn_logit_softcapping``).
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.models.causal_lm import DecoderForCausalLM
from pagedserve.server.models.spec import DecoderSpec, llama_spec_fields


def _gemma_fields(hf_config: Any) -> dict[str, Any]:
    fields = llama_spec_fields(hf_config)
    fields.update(
        hidden_act=getattr(hf_config, "hidden_activation", None) or fields["hidden_act"],
        mlp_bias=False,
        norm_placement="sandwich",
        norm_weight_offset=1.0,
        attn_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        embed_scale=float(hf_config.hidden_size) ** 0.5,
        embed_scale_in_model_dtype=True,
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
    )
    return fields


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec(
            **_gemma_fields(hf_config), attn_softcap=getattr(hf_config, "attn_logit_softcapping", None)
        )


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec(**_gemma_fields(hf_config), qk_norm="head")
