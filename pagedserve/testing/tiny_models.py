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


# The engine settings of a tiny model's test: float32, as HF computes it, and a KV cache of 4 MiB (thousands
# of a tiny model's tokens) instead of the CPU default of 1 GiB, which a suite of such engines would not fit
# in memory.
TINY_ENGINE: dict[str, Any] = {"dtype": "float32", "kv_cache_memory_bytes": 4 << 20}


def random_hf_model(config: Any, seed: int = 0, model_class: Any = None) -> Any:
    """An HF model (eager attention) whose every parameter, biases and norm weights too, is random and
    O(1)-safe. ``config.architectures`` must name the class (or ``model_class`` be it)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if model_class is None:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    else:
        model = model_class._from_config(config, dtype=torch.float32, attn_implementation="eager")
    model = model.eval()
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


def tiny_embedding_checkpoint(folder: Path, pooling: str = "lasttoken", normalize: bool = True,
                              base_model: bool = False, seed: int = 0, **config_fields: Any) -> Path:
    """A tiny random Qwen3 saved as a sentence-transformers embedder: the checkpoint, the tiny tokenizer
    (with a pad token, which batching needs), ``modules.json`` with a Pooling module of ``pooling``
    (sentence-transformers' mode name: lasttoken, mean_tokens, cls_token) and a Normalize module when
    ``normalize``. ``base_model``: saved as ``Qwen3Model`` (no LM head, names without ``model.``), as
    gte-Qwen2 and e5-mistral are. ``config_fields`` go into the config (e.g. ``matryoshka_dimensions``)."""
    import json

    import torch
    from transformers import AutoModel, AutoTokenizer, Qwen3Config

    config = Qwen3Config(**{**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                            "tie_word_embeddings": False, "architectures": ["Qwen3ForCausalLM"],
                            **config_fields})  # fmt: skip
    hf = random_hf_model(config, seed)
    if base_model:
        base = AutoModel.from_config(config, dtype=torch.float32)
        base.load_state_dict(hf.model.state_dict())
        base.config.architectures = ["Qwen3Model"]
        base.save_pretrained(folder)
    else:
        hf.save_pretrained(folder)
    build_tiny_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.save_pretrained(str(folder))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
             "lasttoken")
    pooling_config = {f"pooling_mode_{mode}": mode == pooling for mode in modes}
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": config.hidden_size, **pooling_config, "include_prompt": True})
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    if normalize:
        (folder / "2_Normalize").mkdir(exist_ok=True)
    return folder


# Qwen3's chat template, cut to what its reasoning needs: ChatML turns, and with enable_thinking false an
# empty think block after the generation prompt, so the reply is the answer.
QWEN3_THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_reasoning_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 whose tokenizer has ``<think>`` and ``</think>`` as single tokens (ids 259 and
    260, as Qwen3's vocabulary has them) and Qwen3's thinking chat template."""
    from transformers import Qwen3Config

    config = Qwen3Config(**{**TINY, "vocab_size": TINY_VOCAB + 2, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 16, "architectures": ["Qwen3ForCausalLM"]})
    random_hf_model(config, seed).save_pretrained(folder)
    build_tiny_tokenizer(folder, ("<think>", "</think>"), QWEN3_THINKING_TEMPLATE)
    return folder


# A chat template that renders image parts as LLaVA's placeholder, as the checkpoints' templates do
LLAVA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_IMAGE_TOKEN = TINY_VOCAB  # "<image>", the tokenizer's next id
LLAVA_IMAGE_SIZE = 28  # pixels a side: 2 x 2 patches of 14, so 4 image tokens (the CLS dropped)


def tiny_llava_checkpoint(folder: Path, text_model_type: str = "llama", seed: int = 0,
                          tower: str = "clip") -> Any:
    """A tiny random LLaVA (a CLIP or SigLIP tower, the projector, a Llama or Mistral decoder) saved with
    its processor (an image processor of 28x28 pixels, the tiny tokenizer with ``<image>``); returns the HF
    model. SigLIP has no CLS position: its features are all taken ("full"), 4 image tokens either way."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        MistralConfig,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    text_class = {"llama": LlamaConfig, "mistral": MistralConfig}[text_model_type]
    text = text_class(**{**TINY, "vocab_size": TINY_VOCAB + 1, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "tie_word_embeddings": False})  # fmt: skip
    tower_shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       image_size=LLAVA_IMAGE_SIZE, patch_size=14)  # fmt: skip
    size = {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}
    if tower == "clip":
        vision: Any = CLIPVisionConfig(**tower_shape, projection_dim=32)
        images: Any = CLIPImageProcessor(size={"shortest_edge": LLAVA_IMAGE_SIZE}, crop_size=size)
        strategy, extra_tokens = "default", 1  # the CLS position is dropped
    else:
        vision, images = SiglipVisionConfig(**tower_shape), SiglipImageProcessor(size=size)
        strategy, extra_tokens = "full", 0
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=LLAVA_IMAGE_TOKEN,
                         vision_feature_select_strategy=strategy, vision_feature_layer=-2,
                         architectures=["LlavaForConditionalGeneration"])  # fmt: skip
    hf = random_hf_model(config, seed, LlavaForConditionalGeneration)
    hf.save_pretrained(folder)
    build_tiny_tokenizer(folder, ("<image>",), LLAVA_TEMPLATE)
    processor = LlavaProcessor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(str(folder)),
                               patch_size=14, vision_feature_select_strategy=strategy, image_token="<image>",
                               num_additional_image_tokens=extra_tokens,
                               chat_template=LLAVA_TEMPLATE)  # fmt: skip
    processor.save_pretrained(str(folder))
    return hf


QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def tiny_qwen2_vl_checkpoint(folder: Path, seed: int = 0, version: str = "2") -> Any:
    """A tiny random Qwen2-VL (``version`` "2.5": Qwen2.5-VL, whose tower has window attention) saved with
    its processor (images of 28 to 112 pixels a side, in 14-pixel patches merged 2x2: Transformers'
    processor where it can be built, else its image processor and tokenizer); returns the HF model."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
    )

    ids = {token: TINY_VOCAB + i for i, token in enumerate(QWEN2_VL_TOKENS)}
    text = {**TINY, "vocab_size": TINY_VOCAB + len(QWEN2_VL_TOKENS), "num_attention_heads": 4,
            "num_key_value_heads": 2, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    patches = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_heads": 2}
    if version == "2":
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": TINY["hidden_size"], "mlp_ratio": 2, **patches}
    else:  # window attention in every layer but the full-attention ones
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": TINY["hidden_size"],
                  "intermediate_size": 48, "window_size": 56, "fullatt_block_indexes": [1], **patches}
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"],
                          architectures=[model_class.__name__])  # fmt: skip
    hf = random_hf_model(config, seed, model_class)
    hf.save_pretrained(folder)
    build_tiny_tokenizer(folder, QWEN2_VL_TOKENS, QWEN2_VL_TEMPLATE)
    images = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                   temporal_patch_size=2)  # fmt: skip
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer,
                                     chat_template=QWEN2_VL_TEMPLATE)
        processor.save_pretrained(str(folder))
    except (AttributeError, ImportError, TypeError):  # its video processor needs torchvision
        images.save_pretrained(str(folder))
    return hf
