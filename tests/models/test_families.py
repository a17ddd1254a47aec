"""Every supported family against HF Transformers, through the engine: greedy tokens equal, logprobs close
(tests/models/parity.py), on the torch and cpu backends, float32.

Each case is a tiny random config made with the family's own config class, sized so its quirk decides
tokens: soft-caps small enough to bind, prompts longer than the sliding windows, decodes that cross
LongRoPE's original context.
"""

from __future__ import annotations

import pytest
from parity import BACKENDS, TINY, assert_greedy_parity, checkpoint_fixture, shared_prefix_prompts
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 16  # shorter than the prompts (27 to 48 tokens) and their decodes


def _config(cls, architecture: str, **fields):
    config = cls(**{**TINY, **fields})
    config.architectures = [architecture]
    return config


def _longrope(head_dim: int, original: int) -> dict:
    half = head_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": original,
    }


CASES = {
    "llama": lambda: _config(LlamaConfig, "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "llama3-rope": lambda: _config(
        LlamaConfig, "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=1,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
    ),
    "llama-yarn": lambda: _config(
        LlamaConfig, "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    "llama-linear": lambda: _config(
        LlamaConfig, "LlamaForCausalLM", num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    "llama-dynamic": lambda: _config(
        LlamaConfig, "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "mistral-window": lambda: _config(
        MistralConfig, "MistralForCausalLM", num_attention_heads=8, num_key_value_heads=2,
        sliding_window=WINDOW,
    ),
    "qwen2-window": lambda: _config(
        Qwen2Config, "Qwen2ForCausalLM", num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
    ),
    "qwen3": lambda: _config(
        Qwen3Config, "Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=True,
    ),
    "gemma2": lambda: _config(
        Gemma2Config, "Gemma2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0, layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma3": lambda: _config(
        Gemma3TextConfig, "Gemma3ForCausalLM", num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=WINDOW, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    "phi3-longrope": lambda: _config(
        Phi3Config, "Phi3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
        rope_parameters=_longrope(16, 48), pad_token_id=0,
    ),
    "phi3-partial-rotary": lambda: _config(
        Phi3Config, "Phi3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
        partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5}, pad_token_id=0,
    ),
    "olmo2": lambda: _config(Olmo2Config, "Olmo2ForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "granite": lambda: _config(
        GraniteConfig, "GraniteForCausalLM", num_attention_heads=4, num_key_value_heads=2,
        embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=0.5,
    ),
}  # fmt: skip

# LongRoPE: prompts below original_max_position_embeddings (48) whose decodes cross it, where HF's
# generate and our per-position table agree (server/layers/rotary.py says what differs past it).
ROUNDS = {"phi3-longrope": shared_prefix_prompts(prefix_len=24, lengths=(10, 16, 20))}
MAX_TOKENS = {"phi3-longrope": 12, "mistral-window": 10}


family = checkpoint_fixture(CASES, "family")


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_matches_hf(family, backend):
    name, hf, path = family
    assert_greedy_parity(hf, path, backend, rounds=ROUNDS.get(name), max_tokens=MAX_TOKENS.get(name, 8))
