"""Seeded random-weight checkpoints made from a family's own config class (tests and benchmarks).

``tiny_checkpoint(config, folder)`` saves such a model with ``save_pretrained`` beside the tiny
byte-level tokenizer (pagedserve/testing/tiny_tokenizer.py) and returns the HF model. Torch and
transformers are imported inside the functions: importing this module imports neither.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pagedserve.testing.tiny_tokenizer import build_tiny_tokenizer

# The tiny tokenizer's ids: 256 bytes and 3 special tokens. Model vocabularies are exactly this, so every
# sampled id detokenizes.
TINY_VOCAB = 259
# What every tiny config shares (a test adds its heads and quirks).
TINY = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
)


def random_hf_model(config: Any, seed: int = 0) -> Any:
    """An HF model (eager attention) whose every parameter, biases and norm weights too, is random and
    O(1)-safe. ``config.architectures`` must name the class."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                # Gemma's norms are x * (1 + w): centre them on 1 as well.
                centre = 0.0 if _norm_adds_one(model) else 1.0
                param.copy_(centre + 0.2 * noise)
            elif param.dim() == 1:
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))
    return model


def _norm_adds_one(model: Any) -> bool:
    return model.config.model_type.startswith("gemma")


def tiny_checkpoint(config: Any, folder: Path, seed: int = 0) -> Any:
    """Save a random model of ``config`` and the tiny tokenizer into ``folder``; returns the HF model."""
    hf = random_hf_model(config, seed)
    hf.save_pretrained(folder)
    build_tiny_tokenizer(folder)
    return hf
