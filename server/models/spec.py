"""``DecoderSpec``: what a decoder-only family is, as numbers and choices read from its Hugging Face config.

The skeleton (server/models/decoder.py) builds every family from one of these; a family
(server/models/<family>.py) only says how its config maps onto the fields, by overriding
``DecoderForCausalLM.spec_from_config`` (server/models/causal_lm.py). Reads the Transformers 5 attribute
names and the older ones alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Where a layer's RMSNorms sit around its attention and MLP branches:
# - "pre": Llama; a norm before each branch (input_layernorm, post_attention_layernorm).
# - "sandwich": Gemma 2/3; a norm before and after each branch (input_layernorm, post_attention_layernorm,
#   pre_feedforward_layernorm, post_feedforward_layernorm).
# - "post": OLMo 2; a norm after each branch only (post_attention_layernorm, post_feedforward_layernorm).
NormPlacement = Literal["pre", "sandwich", "post"]
# How q and k are normalised before the rotation: per head over head_dim (Qwen3, Gemma 3), or over the
# whole projection (OLMo 2).
QKNorm = Literal["head", "full"]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass
class DecoderSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Attention type of every layer (FULL_ATTENTION or SLIDING_ATTENTION) and the window of the sliding ones.
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    norm_placement: NormPlacement = "pre"
    # Added to every RMSNorm weight when it is loaded: Gemma's norms compute x * (1 + w).
    norm_weight_offset: float = 0.0
    qk_norm: QKNorm | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    embed_scale: float = (
        1.0  # embeddings times this (Gemma: sqrt(hidden_size); Granite: embedding_multiplier)
    )
    embed_scale_in_model_dtype: bool = False  # round the scale to the model dtype first, as HF's Gemma does
    residual_multiplier: float = 1.0  # each branch's output times this before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    final_logit_softcap: float | None = None  # tanh soft-capping of the logits (Gemma 2/3)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_layers
        if len(self.layer_types) < self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        self.layer_types = self.layer_types[: self.num_layers]  # Transformers reads only these too

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The attention window of layer ``layer_index``; ``None`` for full attention."""
        return self.sliding_window if self.layer_types[layer_index] == SLIDING_ATTENTION else None


def llama_spec_fields(cfg: Any) -> dict[str, Any]:
    """The fields every Llama-shaped config has, as ``DecoderSpec`` keyword arguments."""
    num_heads = cfg.num_attention_heads
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act=getattr(cfg, "hidden_act", None) or "silu",
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        layer_types=list(getattr(cfg, "layer_types", None) or []),
        sliding_window=getattr(cfg, "sliding_window", None),
    )
