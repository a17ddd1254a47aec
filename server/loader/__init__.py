"""Finding and loading model weights.

- ``default_model()``: the embedded SmolLM2-135M-Instruct, converted once into the user cache.
- ``resolve_model(model)``: None, a folder, a ``.gguf`` file or a Hugging Face hub id -> a local folder.
- ``load_model(path, dtype, device, backend=...)``: our torch model with the folder's safetensors loaded,
  and its config.
- ``sampling_defaults(path, generation_config)``: generation_config.json's sampling values (request defaults).

Exports are lazy: resolving a folder (or finding the default model's tokenizer) never imports torch;
resolving a hub id or a GGUF file checks its architecture against the model registry first, which does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {
    "default_model": "pagedserve.server.loader.default_model",
    "resolve_model": "pagedserve.server.loader.resolve",
    "load_model": "pagedserve.server.loader.weights",
    "load_config": "pagedserve.server.loader.weights",
    "resolve_dtype": "pagedserve.server.loader.weights",
    "sampling_defaults": "pagedserve.server.loader.generation_config",
}

__all__ = [
    "default_model",
    "load_config",
    "load_model",
    "resolve_dtype",
    "resolve_model",
    "sampling_defaults",
]

if TYPE_CHECKING:
    from pagedserve.server.loader.default_model import default_model
    from pagedserve.server.loader.generation_config import sampling_defaults
    from pagedserve.server.loader.resolve import resolve_model
    from pagedserve.server.loader.weights import load_config, load_model, resolve_dtype


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
