"""Qwen2-VL and Qwen2.5-VL: Transformers' vision transformer (its patch merger included) before our Qwen2
decoder, which rotates by multimodal RoPE (server/layers/rotary.py ``MRotaryEmbedding``).

As with LLaVA (server/models/llava.py), the vision tower is Transformers' own module loaded with the
checkpoint's weights, so image features are HF's by construction. An image's tokens take 3-D positions
(temporal, height, width of its merged patch grid); the front end computes every prompt position
(server/multimodal.py ``mrope_positions``, HF's ``get_rope_index`` for images) and the offset that
positions after the prompt keep (``Request.mrope_delta``); the runner hands the decoder ``[3, T]``
positions.

Checkpoint names: the decoder ``model.language_model.*`` (newer) or ``model.*`` (older), the tower
``model.visual.*`` or ``visual.*``, the head ``lm_head``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pagedserve.server.backend import Backend
from pagedserve.server.layers.rotary import MRotaryEmbedding, rope_parameters
from pagedserve.server.models.causal_lm import WeightKey
from pagedserve.server.models.qwen2 import Qwen2ForCausalLM
from torch import nn

_ENCODER_PREFIXES = ("model.visual.", "visual.")


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    supports_tensor_parallel: ClassVar[bool] = False  # the tower is Transformers', on one rank
    uses_mrope: ClassVar[bool] = True
    encoder_prefixes: ClassVar[tuple[str, ...]] = _ENCODER_PREFIXES

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 backend: Backend) -> None:
        super().__init__(hf_config.text_config, dtype, device, backend)
        section = rope_parameters(hf_config.text_config).get("mrope_section")
        if not section:
            raise ValueError("a Qwen2-VL config needs rope_parameters.mrope_section")
        self.model.rotary_emb = nn.ModuleDict(
            {name: MRotaryEmbedding(table, section) for name, table in self.model.rotary_emb.items()}
        )
        self.encoder = vision_tower(hf_config.vision_config, dtype, torch.device(device))

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """One image's merged features ``[tokens, hidden]``, as HF's ``get_image_features`` makes them."""
        dtype = next(self.encoder.parameters()).dtype
        return self.encoder(pixel_values.to(dtype), grid_thw=image_grid_thw).pooler_output

    def load_encoder(self, tensors: dict[str, torch.Tensor]) -> None:
        state = {name.removeprefix("model.").removeprefix("visual."): t for name, t in tensors.items()}
        missing, unexpected = self.encoder.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"the vision tower's weights do not match: missing {missing[:8]}, "
                             f"unknown {unexpected[:8]}")

    def route_weight(self, name: str) -> WeightKey | None:
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        return super().route_weight(name)



def vision_tower(vision_config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Transformers' vision transformer of the config's kind (Qwen2-VL's or Qwen2.5-VL's)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    towers = {"qwen2_vl_vision": Qwen2VisionTransformerPretrainedModel,
              "qwen2_5_vl_vision": Qwen2_5_VisionTransformerPretrainedModel}  # fmt: skip
    if vision_config.model_type not in towers:
        raise ValueError(f"a {vision_config.model_type!r} vision tower is not supported: {', '.join(towers)}")
    tower = towers[vision_config.model_type]._from_config(vision_config, attn_implementation="eager")
    return tower.to(dtype=dtype, device=device).eval()
