"""Weight quantization, chosen once at load by name (vLLM's ``quantization`` config key / ``-q`` flag).

``quantize_linears(model, name, kernels)`` gives every ``Linear`` of a freshly built model (before its
weights are loaded) the method's weight format; the loader (server/loader/weights.py) calls it, and the
layers then quantize each checkpoint tensor as it arrives. The LM head stays in the model dtype, as in
vLLM (the logits are the most sensitive product, and a tied head is the embedding table).
"""

from __future__ import annotations

from types import ModuleType

from pagedserve.server.layers.quantization.base import LinearMethod
from pagedserve.server.layers.quantization.int8 import Int8LinearMethod
from torch import nn

QUANTIZATION_METHODS = ("int8",)
UNQUANTIZED_MODULES = ("lm_head",)


def get_linear_method(name: str, kernels: ModuleType) -> LinearMethod:
    """The method for mode ``name``, running the backend's kernels; ``ValueError`` for an unknown one."""
    if name == "int8":
        return Int8LinearMethod(kernels.w8a16_matmul)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None), got {name!r}")


def quantize_linears(model: nn.Module, name: str | None, kernels: ModuleType) -> None:
    """Switch every ``Linear`` of ``model`` but the LM head to mode ``name`` (None: leave them)."""
    from pagedserve.server.layers.linear import Linear

    if name is None:
        return
    method = get_linear_method(name, kernels)
    for module_name, module in model.named_modules():
        if isinstance(module, Linear) and module_name not in UNQUANTIZED_MODULES:
            module.set_method(method)


__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "get_linear_method", "quantize_linears"]
