"""LLaVA: a vision tower (CLIP or SigLIP) and a projector in front of a Llama or Mistral decoder.

The decoder is ours (paged, batched, the family's kernels); the vision tower and the projector are
Transformers' own modules built from the checkpoint's config and loaded with its weights, so image
features are HF's by construction (the encoder runs once per image, not per token, so it is not on the
decode path). ``encode_images`` is HF's ``LlavaModel.get_image_features``: the hidden states of
``vision_feature_layer`` (several concatenated), without the CLS position under the "default" strategy,
through the projector. The runner (server/worker/model_runner.py) merges them into the step's
embeddings at each image's placeholder tokens (server/multimodal.py).

Checkpoint names: Transformers' LLaVA checkpoints name the decoder ``language_model.model.*`` (older) or
``model.language_model.*`` (newer), the head ``language_model.lm_head`` or ``lm_head``, the tower
``vision_tower.*`` with or without ``vision_model.``; all map here.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pagedserve.server.backend import Backend
from pagedserve.server.models.causal_lm import DecoderForCausalLM, WeightKey
from pagedserve.server.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.server.models.spec import DecoderSpec
from torch import nn

# The decoders a LLaVA checkpoint's text_config may name (its model_type)
TEXT_FAMILIES: dict[str, type[DecoderForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": MistralForCausalLM,
}
_DECODER_PREFIXES = ("model.language_model.", "language_model.model.")
_HEAD_PREFIXES = ("language_model.lm_head.",)
_ENCODER_PREFIXES = (
    "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.",
)


class VisionEncoder(nn.Module):
    """Transformers' vision tower and LLaVA projector, as ``LlavaModel`` holds them."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        super().__init__()
        self.vision_tower = AutoModel.from_config(hf_config.vision_config, attn_implementation="eager")
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config)
        self.to(dtype=dtype, device=device).eval()
        self.feature_layer = hf_config.vision_feature_layer
        self.select_strategy = hf_config.vision_feature_select_strategy

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[images, C, H, W]`` -> features ``[images, tokens per image, hidden]``."""
        dtype = next(self.parameters()).dtype
        states = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        selected = [states[layer] for layer in layers]
        if self.select_strategy == "default":  # the CLS position is not an image token
            selected = [state[:, 1:] for state in selected]
        return self.multi_modal_projector(torch.cat(selected, dim=-1))

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """The tower's and projector's checkpoint tensors (names without the model prefix); a missing or
        unknown one is a ValueError naming it, as for the decoder."""
        expected = self.state_dict()
        state = {}
        for name, tensor in tensors.items():
            for candidate in (name, name.replace("vision_tower.", "vision_tower.vision_model.", 1),
                              name.replace("vision_tower.vision_model.", "vision_tower.", 1)):  # fmt: skip
                if candidate in expected:
                    state[candidate] = tensor
                    break
            else:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the vision encoder")
        missing = [name for name in expected if name not in state and not name.endswith("position_ids")]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} vision encoder weights: "
                             f"{', '.join(missing[:8])}")
        self.load_state_dict(state, strict=False)


class LlavaForConditionalGeneration(DecoderForCausalLM):
    # The encoder's modules are Transformers', which do not split across ranks
    supports_tensor_parallel: ClassVar[bool] = False
    encoder_prefixes: ClassVar[tuple[str, ...]] = _ENCODER_PREFIXES

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 backend: Backend) -> None:
        super().__init__(hf_config.text_config, dtype, device, backend)
        self.image_token_id = int(hf_config.image_token_index)
        self.encoder = VisionEncoder(hf_config, dtype, torch.device(device))

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        family = TEXT_FAMILIES.get(hf_config.model_type)
        if family is None:
            raise ValueError(f"LLaVA over a {hf_config.model_type!r} decoder is not supported: "
                             f"{', '.join(TEXT_FAMILIES)} only")
        return family.spec_from_config(hf_config)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's features ``[tokens, hidden]`` (server/multimodal.py ``ImageInput.encoder_inputs``)."""
        return self.encoder(pixel_values)[0]

    def load_encoder(self, tensors: dict[str, torch.Tensor]) -> None:
        self.encoder.load_checkpoint({name.removeprefix("model."): t for name, t in tensors.items()})

    def route_weight(self, name: str) -> WeightKey | None:
        for prefix in _DECODER_PREFIXES:
            if name.startswith(prefix):
                return super().route_weight("model." + name[len(prefix) :])
        for prefix in _HEAD_PREFIXES:
            if name.startswith(prefix):
                return super().route_weight("lm_head." + name[len(prefix) :])
        return super().route_weight(name)
