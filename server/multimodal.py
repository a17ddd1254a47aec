"""Images in a prompt: what the front end makes of them and what the engine core carries (vLLM's
multimodal inputs, for images).

The front end's processor (server/engine/processor.py) runs the checkpoint's own Transformers processor
(``AutoProcessor``) over the prompt's text and images: it expands each image's placeholder into the run of
image tokens the model expects and makes the pixel values. Each image becomes an ``ImageInput``: where its
run starts and how long it is, its pixels, and a hash of them. The core never decodes an image: the
runner encodes the pixels once per request (shared between requests by hash while any holds them,
server/worker/model_runner.py) and merges the features over the run's rows, whatever chunk of the prompt
a step computes; the prefix cache mixes the hash into the hash of every block the run touches
(server/core/kv_cache_manager.py), so two images after the same text never share a block.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.common.engine_args import json_object
from pagedserve.server.exceptions import InvalidRequestError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    offset: int  # the first placeholder token's position in the prompt
    length: int  # placeholder tokens: the encoder's features per image
    hash: bytes  # of the encoder's inputs, so equal hashes mean equal features
    # The model's encoder's keyword arguments for this image alone, as the checkpoint's image processor made
    # them: LLaVA's pixel_values [1, C, H, W]; Qwen2-VL's patches [n, dim] and image_grid_thw [1, 3]
    encoder_inputs: dict[str, torch.Tensor]

    def rows_in(self, start: int, end: int) -> tuple[int, int] | None:
        """The part ``[first, last)`` of this image's run that positions ``[start, end)`` cover."""
        first, last = max(start, self.offset), min(end, self.offset + self.length)
        return (first - self.offset, last - self.offset) if first < last else None


def takes_images(hf_config: Any) -> bool:
    """A vision-language checkpoint: Transformers' configs of those carry a ``vision_config``."""
    return getattr(hf_config, "vision_config", None) is not None


def is_mrope(hf_config: Any) -> bool:
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): the text config's RoPE parameters split by section."""
    text = hf_config.get_text_config()
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return bool(params.get("mrope_section"))


def inputs_hash(inputs: dict[str, torch.Tensor]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        data = inputs[name].detach().contiguous().cpu()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.numpy().tobytes())
    return digest.digest()


def as_images(value: Any) -> list[Any]:
    """``multi_modal_data["image"]``: one image or a list of them (vLLM's forms)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def process_images(hf_processor: Any, image_token_id: int, text: str, images: list[Any],
                   add_special_tokens: bool = True) -> tuple[list[int], list[ImageInput]]:
    """The prompt's token ids, each image's placeholder expanded, and its images; InvalidRequestError when
    the prompt's placeholders and the images do not pair up."""
    try:
        batch = hf_processor(text=text, images=images, return_tensors="pt",
                             add_special_tokens=add_special_tokens)
    except (ValueError, TypeError, OSError) as exc:  # the processor's own refusals: count, format, mode
        raise InvalidRequestError(f"the images could not be processed: {exc}", param="prompt") from exc
    token_ids = [int(t) for t in batch["input_ids"][0]]
    runs = placeholder_runs(token_ids, image_token_id)
    if len(runs) != len(images):
        raise InvalidRequestError(
            f"the prompt has {len(runs)} image placeholders for {len(images)} images", param="prompt"
        )
    images_in = []
    for (offset, length), inputs in zip(runs, per_image_inputs(batch, len(images)), strict=True):
        images_in.append(ImageInput(offset, length, inputs_hash(inputs), inputs))
    return token_ids, images_in


def per_image_inputs(batch: Any, num_images: int) -> list[dict[str, torch.Tensor]]:
    """The processor's batched encoder inputs cut per image: pixel_values by image (LLaVA), or, with an
    ``image_grid_thw`` (Qwen2-VL), its patch rows by each image's grid."""
    pixels = batch["pixel_values"]
    if "image_grid_thw" not in batch:
        return [{"pixel_values": pixels[i : i + 1]} for i in range(num_images)]
    grids = batch["image_grid_thw"]
    sizes = [int(n) for n in grids.prod(-1)]
    return [{"pixel_values": part, "image_grid_thw": grids[i : i + 1]}
            for i, part in enumerate(pixels.split(sizes))]  # fmt: skip


def placeholder_runs(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of the image token, in order."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(token_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


MODALITIES = ("image",)


def parse_mm_limits(value: dict[str, int] | str | None) -> dict[str, int] | None:
    """``--limit-mm-per-prompt``'s JSON (or the dict ``LLM(limit_mm_per_prompt=...)`` takes), checked."""
    value = json_object("limit_mm_per_prompt", value, MODALITIES)
    if value is None:
        return None
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in value.values()):
        raise ValueError(f"limit_mm_per_prompt's limits must be integers >= 0, got {value!r}")
    return value


def mrope_positions(num_tokens: int, images: list[ImageInput], spatial_merge_size: int,
                    ) -> tuple[torch.Tensor, int]:
    """Every prompt position's (temporal, height, width) and the offset of the positions after the prompt
    (HF's ``get_rope_index``, for images): text runs count on from the last position; an image's tokens
    take its merged grid's coordinates from there, which then advance by the grid's longer side."""
    import torch

    parts: list[torch.Tensor] = []
    current = cursor = 0
    for image in images:
        offset, length = image.offset, image.length
        t, h, w = (int(n) for n in image.encoder_inputs["image_grid_thw"][0])
        text_len = offset - cursor
        parts.append(torch.arange(text_len).view(1, -1).expand(3, -1) + current)
        current += text_len
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw),
                                                indexing="ij")
        parts.append(torch.stack([grid_t + current, grid_h + current, grid_w + current]).reshape(3, -1))
        if parts[-1].shape[1] != length:
            raise InvalidRequestError(f"an image's grid {t}x{h}x{w} gives {parts[-1].shape[1]} tokens, not "
                                      f"its {length} placeholders", param="prompt")
        current += max(gh, gw)
        cursor = offset + length
    parts.append(torch.arange(num_tokens - cursor).view(1, -1).expand(3, -1) + current)
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens


class GridImageProcessor:
    """Transformers' Qwen2-VL processor, for images, where it cannot be built: its constructor needs a
    video processor, which needs torchvision even when no video is sent. The checkpoint's own image
    processor makes the patches and grids; each image's placeholder token becomes as many tokens as its
    grid has merged patches, which is all Qwen2VLProcessor does to the text."""

    def __init__(self, image_processor: Any, tokenizer: Any, image_token: str, merge_size: int) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.image_token, self.merge_size = image_token, merge_size

    def __call__(self, text: str, images: list[Any], return_tensors: str = "pt",
                 add_special_tokens: bool = True) -> dict[str, Any]:
        batch = dict(self.image_processor(images=images, return_tensors=return_tensors))
        counts = [int(n) // self.merge_size**2 for n in batch["image_grid_thw"].prod(-1)]
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"the text has {len(pieces) - 1} {self.image_token} tokens for {len(counts)} "
                             "images")
        runs = [self.image_token * n + piece for n, piece in zip(counts, pieces[1:], strict=True)]
        encoded = self.tokenizer(pieces[0] + "".join(runs), add_special_tokens=add_special_tokens,
                                 return_tensors=return_tensors)
        return {"input_ids": encoded["input_ids"], **batch}
