"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors`` or ``.bin``) into
the stacked form of server/lora/layers.py, checking everything at load so a bad adapter is refused with
its reason (``LoRALoadError``) before any request uses it.

PEFT names a tensor ``base_model.model.<checkpoint module>.lora_A.weight``; the model's own weight
routing (``DecoderForCausalLM.route_weight``) maps the checkpoint module onto ours, so q/k/v land in
``qkv_proj``'s slices and gate/up in ``gate_up_proj``'s. Each slice's A goes to rows ``i*R .. i*R+r`` and
its B, times PEFT's scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA), to the slice's output
rows and columns ``i*R .. i*R+r`` (R = max_lora_rank), as kernels/reference.py lays them out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pagedserve.server.lora_request import LoRALoadError, LoRARequest

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Module path -> the adapter's (A, B) for that layer, already padded to the layer's stacked shapes.
AdapterWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoRATarget:
    """A LoRA-capable projection: its input size and its merged slices' output sizes."""

    in_features: int
    output_sizes: tuple[int, ...]


@dataclass(frozen=True)
class LoRAModelInfo:
    """What an adapter is checked against: the model's LoRA layers and how checkpoint names map onto them."""

    targets: dict[str, LoRATarget]  # our module path -> the layer
    # checkpoint module path -> (our module path, slice index or None for the whole merged matrix)
    route: Callable[[str], tuple[str, int | None]]
    module_names: frozenset[str]  # the checkpoint modules' last names an adapter may target (q_proj, ...)
    max_lora_rank: int
    dtype: torch.dtype


def resolve_adapter_path(lora_path: str) -> Path:
    """A local folder, else a Hugging Face id fetched with snapshot_download (the adapter files only)."""
    path = Path(lora_path).expanduser()
    if path.is_dir():
        return path
    if path.exists() or lora_path.startswith((".", "/", "~")) or lora_path.count("/") != 1:
        raise LoRALoadError(f"LoRA adapter path {lora_path!r} is not a folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(lora_path, allow_patterns=[CONFIG_FILE, *WEIGHT_FILES]))
    except Exception as exc:
        raise LoRALoadError(f"LoRA adapter {lora_path!r} is neither a folder nor a reachable "
                            f"Hugging Face repository: {exc}") from exc


def read_adapter_config(folder: Path, info: LoRAModelInfo) -> dict[str, Any]:
    """The adapter's config, refused unless it is a plain LoRA this engine can serve."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError as exc:
        raise LoRALoadError(f"{folder} is not a PEFT adapter: it has no {CONFIG_FILE}") from exc
    except (OSError, ValueError) as exc:
        raise LoRALoadError(f"{folder}/{CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise LoRALoadError(f"{folder} is not a PEFT LoRA adapter (peft_type {kind!r}, not 'LORA')")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRALoadError(f"adapter_config.json has no valid rank r: {rank!r}")
    if rank > info.max_lora_rank:
        raise LoRALoadError(f"LoRA rank {rank} is greater than max_lora_rank {info.max_lora_rank}")
    if config.get("use_dora"):
        raise LoRALoadError("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise LoRALoadError(f"LoRA bias {config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise LoRALoadError(f"modules_to_save {config['modules_to_save']} is not supported: only LoRA "
                            "on the projections, no fully trained modules")
    if config.get("alpha_pattern") or config.get("rank_pattern"):
        raise LoRALoadError("per-module rank_pattern / alpha_pattern are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - info.module_names)
        if unknown:
            raise LoRALoadError(f"target modules {unknown} are not LoRA-capable modules of this model "
                                f"(it has {sorted(info.module_names)}; no embedding or lm_head adapters)")
    return config


def read_adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file), device="cpu")
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise LoRALoadError(f"cannot read {file}: {exc}") from exc
    raise LoRALoadError(f"{folder} is not a PEFT adapter: it has none of {', '.join(WEIGHT_FILES)}")


def load_peft_adapter(lora: LoRARequest, info: LoRAModelInfo) -> AdapterWeights:
    """The adapter's weights per layer, stacked and scaled; ``LoRALoadError`` naming what is wrong."""
    folder = resolve_adapter_path(lora.lora_path)
    config = read_adapter_config(folder, info)
    pairs = _pair_tensors(read_adapter_tensors(folder))
    alpha = float(config.get("lora_alpha", config["r"]))
    weights: AdapterWeights = {}
    for module, (a, b) in sorted(pairs.items()):
        if module.rpartition(".")[2] not in info.module_names:
            raise LoRALoadError(f"target module {module!r} is not a LoRA-capable module of this model")
        path, shard = info.route(module)
        target = info.targets.get(path)
        if target is None:
            raise LoRALoadError(f"target module {module!r} is not in this model")
        rank = a.shape[0]
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        stacked = weights.get(path) or _zeros(target, info)
        _place(stacked, target, info.max_lora_rank, shard, a, b * scaling, module)
        weights[path] = stacked
    if not weights:
        raise LoRALoadError(f"{folder} holds no LoRA weights")
    return {path: (a.to(info.dtype), b.to(info.dtype)) for path, (a, b) in weights.items()}


def _pair_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module path -> (lora_A, lora_B) weights, float32."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = name.removeprefix(PEFT_PREFIX).replace(".default.", ".")
        if "lora_embedding" in key or "embed_tokens" in key or key.startswith("lm_head"):
            raise LoRALoadError(f"embedding and lm_head adapters are not supported ({name})")
        module, _, kind = key.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise LoRALoadError(f"unexpected tensor {name!r} (only lora_A/lora_B weights are supported)")
        found.setdefault(module, {})[kind[0]] = tensor.float()
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise LoRALoadError(f"module {module!r} has lora_{'A' if 'A' in ab else 'B'} but not both")
        if ab["A"].dim() != 2 or ab["B"].dim() != 2 or ab["A"].shape[0] != ab["B"].shape[1]:
            raise LoRALoadError(f"module {module!r}: lora_A {tuple(ab['A'].shape)} and lora_B "
                                f"{tuple(ab['B'].shape)} do not make a rank-r pair")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _zeros(target: LoRATarget, info: LoRAModelInfo) -> tuple[torch.Tensor, torch.Tensor]:
    rank_size = len(target.output_sizes) * info.max_lora_rank
    return torch.zeros(rank_size, target.in_features), torch.zeros(sum(target.output_sizes), rank_size)


def _place(
    stacked: tuple[torch.Tensor, torch.Tensor],
    target: LoRATarget,
    max_rank: int,
    shard: int | None,
    a: torch.Tensor,
    b: torch.Tensor,
    module: str,
) -> None:
    """Copy one checkpoint module's (A, scaled B) into its slice of the layer's stacked pair."""
    rank = a.shape[0]
    if rank > max_rank:
        raise LoRALoadError(f"module {module!r} has rank {rank}, greater than max_lora_rank {max_rank}")
    index = shard or 0
    offset = 0 if shard is None else sum(target.output_sizes[:shard])
    size = sum(target.output_sizes) if shard is None else target.output_sizes[shard]
    if a.shape[1] != target.in_features or b.shape[0] != size:
        raise LoRALoadError(f"module {module!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                            f"fit this model's layer ({target.in_features} in, {size} out)")
    stacked_a, stacked_b = stacked
    stacked_a[index * max_rank : index * max_rank + rank] = a
    stacked_b[offset : offset + size, index * max_rank : index * max_rank + rank] = b
