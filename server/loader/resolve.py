"""``resolve_model``: turn the engine's ``model`` argument into a local Hugging Face folder.

An architecture the engine cannot run fails here, naming it and the supported list, before a hub
download of the weights or a GGUF conversion starts (a folder's config is checked by ``load_model``
before its weights are read).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pagedserve.server.loader.default_model import default_model, ensure_converted, gguf_cache_dir

# What a snapshot needs: config, weights, tokenizer, chat template. Not *.bin/*.pth/*.gguf duplicates.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model(model: str | None) -> Path:
    """A local folder holding ``model``.

    - ``None``: the embedded default model (``default_model()``).
    - an existing folder: that folder.
    - an existing ``.gguf`` file: converted once into the cache (as the default model is).
    - otherwise a Hugging Face hub id: the local HF cache first, then a download unless
      ``HF_HUB_OFFLINE`` is set.

    Raises ``FileNotFoundError`` (a missing path, or a hub id neither cached nor downloadable) or
    ``ValueError`` (neither a path nor a valid hub id); the message names ``model``.
    """
    if model is None:
        return Path(default_model())
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix == ".gguf":
            _check_architectures(gguf_architectures(path))
            return ensure_converted(path, gguf_cache_dir(path))
        raise ValueError(f"model {model!r} is a file; expected a model folder, a .gguf file or a hub id")
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or (os.sep != "/" and os.sep in model):
        raise FileNotFoundError(f"model {model!r}: no such folder")
    return _hub_snapshot(model)


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE")
    if flag is not None:
        return flag.strip().upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE)


def _hub_snapshot(model: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, local_files_only=True, allow_patterns=ALLOW_PATTERNS))
    except HFValidationError as error:
        raise ValueError(f"model {model!r} is neither a folder nor a valid Hugging Face hub id") from error
    except LocalEntryNotFoundError:
        pass
    if _offline():
        raise FileNotFoundError(
            f"model {model!r} is not a local folder and not in the Hugging Face cache, "
            "and HF_HUB_OFFLINE is set: download it first or pass a folder"
        )
    try:
        config = Path(snapshot_download(model, allow_patterns=["config.json"])) / "config.json"
        if config.is_file():
            _check_architectures(json.loads(config.read_text()).get("architectures") or [])
        return Path(snapshot_download(model, allow_patterns=ALLOW_PATTERNS))
    except ValueError:
        raise
    except Exception as error:  # network, auth, unknown repo: all mean "cannot get this model"
        raise FileNotFoundError(f"model {model!r} could not be downloaded from the hub: {error}") from error


def gguf_architectures(path: Path) -> list[str]:
    """The architecture a GGUF file converts to (Transformers' causal-LM class for its model type), read
    from its metadata alone."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = load_gguf_checkpoint(str(path), return_tensors=False)["config"].get("model_type")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [name] if name else [f"GGUF model type {model_type!r}"]


def _check_architectures(names: list[str]) -> None:
    from pagedserve.server.models.registry import check_architectures

    check_architectures(names)
