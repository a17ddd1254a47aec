"""Model classes by the ``architectures`` entry of a Hugging Face config.

A family's base-model architecture (``Qwen3Model``, ``MistralModel``: the decoder without its LM head, as
embedding checkpoints such as gte-Qwen2 and e5-mistral are saved) runs on the same class under the
pooling runner only (``BASE_MODEL_ARCHITECTURES``; ``is_base_model``).
``supported_architectures()`` is the one list the server shows (``/version``, ``pagedserve serve --help``)
and docs/models.md's table follows (tests/models/test_registry.py).
"""

from __future__ import annotations

from typing import Any

import torch
from pagedserve.server.backend import Backend
from pagedserve.server.models.causal_lm import DecoderForCausalLM
from pagedserve.server.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedserve.server.models.granite import GraniteForCausalLM
from pagedserve.server.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.server.models.llava import LlavaForConditionalGeneration
from pagedserve.server.models.mixtral import MixtralForCausalLM
from pagedserve.server.models.olmo2 import Olmo2ForCausalLM
from pagedserve.server.models.phi3 import Phi3ForCausalLM
from pagedserve.server.models.qwen2 import Qwen2ForCausalLM
from pagedserve.server.models.qwen2_vl import Qwen2VLForConditionalGeneration
from pagedserve.server.models.qwen3 import Qwen3ForCausalLM
from pagedserve.server.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from torch import nn

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 1-3, SmolLM, and most Llama-architecture fine-tunes
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # text-only Gemma 3 (Gemma3TextConfig, model_type gemma3_text)
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # Images in: a CLIP or SigLIP tower and a projector before a Llama or Mistral decoder
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    # Transformers' vision transformer before our Qwen2 decoder, with multimodal RoPE
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
}

# Each family's decoder without its head: ``<Family>Model`` in Transformers (Gemma 3's text decoder is
# ``Gemma3TextModel``). Pooling only: there is no LM head to sample from.
BASE_MODEL_ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    ("Gemma3TextModel" if name == "Gemma3ForCausalLM" else name.removesuffix("ForCausalLM") + "Model"): cls
    for name, cls in MODEL_REGISTRY.items()
    if name.endswith("ForCausalLM")
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def is_base_model(hf_config: Any) -> bool:
    """The config names a base-model architecture (no LM head), which only the pooling runner runs."""
    name = check_architectures(list(getattr(hf_config, "architectures", None) or []))
    return name in BASE_MODEL_ARCHITECTURES


def check_architectures(names: list[str]) -> str:
    """The first supported name among a config's ``architectures``; a ValueError naming them and the
    supported list otherwise. Called before any weights are read, downloaded or converted
    (server/loader/resolve.py, server/loader/weights.py)."""
    for name in names:
        if name in MODEL_REGISTRY or name in BASE_MODEL_ARCHITECTURES:
            return name
    raise ValueError(
        f"unsupported model architecture {names or '(none given in config.json)'}; "
        f"supported: {', '.join(supported_architectures())} (and, for the pooling runner, each one's base "
        "model: LlamaModel, Qwen3Model, ...)"
    )


def get_model_class(hf_config: Any) -> type[DecoderForCausalLM]:
    """The class for the first supported name in ``hf_config.architectures``; ValueError otherwise."""
    name = check_architectures(list(getattr(hf_config, "architectures", None) or []))
    return MODEL_REGISTRY.get(name) or BASE_MODEL_ARCHITECTURES[name]


def build_model(
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: Backend,
) -> nn.Module:
    """An uninitialised model for ``hf_config`` on ``device`` running ``backend``'s kernels (fill it with
    ``model.load_weights``)."""
    return get_model_class(hf_config)(hf_config, dtype, device, backend)


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """ValueError, naming the numbers, unless the model splits across ``size`` ranks: query heads and
    the MLP width divide by it, and KV heads divide by it or it by them (then they are replicated)."""
    if size == 1:
        return
    model_class = get_model_class(hf_config)
    if not model_class.supports_tensor_parallel:
        raise ValueError(f"{model_class.__name__} does not support tensor parallelism yet "
                         f"(tensor_parallel_size {size}); run it with tensor_parallel_size 1")
    spec = model_class.spec_from_config(hf_config)
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"tensor_parallel_size {size} does not split the model's attention heads: "
            f"{heads} query heads and {kv_heads} KV heads (query heads must divide by it, KV heads by it "
            f"or it by them)"
        )
    if spec.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the MLP's intermediate_size "
                         f"{spec.intermediate_size}")


def check_pipeline_parallel(hf_config: Any, size: int) -> None:
    """ValueError unless the model's layers cut into ``size`` stages: a decoder without an encoder (a
    vision tower's features enter at the first stage, which is not built for them yet), with at least
    one layer per stage."""
    if size == 1:
        return
    model_class = get_model_class(hf_config)
    if model_class.encoder_prefixes or model_class.uses_mrope:
        raise ValueError(f"{model_class.__name__} does not support pipeline parallelism yet "
                         f"(pipeline_parallel_size {size}); run it with pipeline_parallel_size 1")
    layers = model_class.spec_from_config(hf_config).num_layers
    if layers < size:
        raise ValueError(f"pipeline_parallel_size {size} exceeds the model's {layers} layers")
