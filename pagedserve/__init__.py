"""pagedserve: a paged-attention LLM engine, a KV-cache-aware router and a Kubernetes operator.

The engine's names are exported lazily so that `import pagedserve.router` (slim image, no torch)
never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.version import __version__

_LAZY = {
    "LLM": "pagedserve.server.entrypoints.llm",
    "LoRARequest": "pagedserve.server.lora_request",
    "SamplingParams": "pagedserve.server.sampling_params",
    "StructuredOutputsParams": "pagedserve.server.sampling_params",
    "RequestOutput": "pagedserve.server.outputs",
    "CompletionOutput": "pagedserve.server.outputs",
    "EngineConfig": "pagedserve.server.config",
    "default_model": "pagedserve.server.loader.default_model",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
    "default_model",
]

if TYPE_CHECKING:
    from pagedserve.server.config import EngineConfig
    from pagedserve.server.entrypoints.llm import LLM
    from pagedserve.server.loader.default_model import default_model
    from pagedserve.server.lora_request import LoRARequest
    from pagedserve.server.outputs import CompletionOutput, RequestOutput
    from pagedserve.server.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
