"""Weight quantization, chosen once at load by name (vLLM's ``quantization`` config key / ``-q`` flag).

``quantize_linears(model, name, kernels)`` gives every ``Linear`` of a freshly built model (before its
weights are loaded) the method's weight format; the loader (server/loader/weights.py) calls it, and the
layers then quantize each checkpoint tensor as it arrives. The LM head is quantized too, tied or not:
vLLM leaves it in the model dtype, but on a CPU the small models' head is a large share of the bytes a
decode step reads (the embedded model's tied head: 113 of 219 MB a token with int8 projections), and
the perplexity test (tests/models/test_quantization.py) holds with it quantized. A tied embedding is
quantized because it is the head; an untied one is only looked up, and stays. FP8 leaves the head in the
model dtype, as vLLM does (``LinearMethod.quantizes_head``): its activations are quantized too, and with
the head's the embedded model's perplexity moved +2.5%, past the test's 2%. "gguf" quantizes nothing:
the loader hands its layers the GGUF file's blocks (server/loader/gguf.py).
"""

from __future__ import annotations

from types import ModuleType

from pagedserve.common.engine_args import QUANTIZATION_METHODS
from pagedserve.server.layers.quantization.base import LinearMethod
from pagedserve.server.layers.quantization.fp8 import Fp8LinearMethod
from pagedserve.server.layers.quantization.gguf import GGUFLinearMethod
from pagedserve.server.layers.quantization.int8 import Int8LinearMethod
from torch import nn


def get_linear_method(name: str, kernels: ModuleType) -> LinearMethod:
    """The method for mode ``name``, running the backend's kernels; ``ValueError`` for an unknown one."""
    if name == "int8":
        return Int8LinearMethod(kernels.w8a16_matmul)
    if name == "fp8":
        return Fp8LinearMethod(kernels.fp8_matmul)
    if name == "gguf":
        return GGUFLinearMethod(kernels.gguf_matmul, getattr(kernels, "gguf_dense_weight", None))
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None), got {name!r}")


def quantize_linears(model: nn.Module, name: str | None, kernels: ModuleType) -> None:
    """Switch every ``Linear`` of ``model``, and its embedding where it is the tied LM head, to mode
    ``name`` (None: leave them)."""
    from pagedserve.server.layers.linear import Linear, VocabEmbedding

    if name is None:
        return
    method = get_linear_method(name, kernels)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        tied_head = tied and isinstance(module, VocabEmbedding)
        is_head = module is head or tied_head
        if (isinstance(module, Linear) or tied_head) and (method.quantizes_head or not is_head):
            module.set_method(method)


def process_weights_after_loading(model: nn.Module) -> None:
    """Every layer's method finishes its weights, once the checkpoint is loaded (``LinearMethod``)."""
    for module in model.modules():
        method = getattr(module, "method", None)
        if isinstance(method, LinearMethod):
            method.process_weights_after_loading(module)


__all__ = [
    "QUANTIZATION_METHODS",
    "LinearMethod",
    "get_linear_method",
    "process_weights_after_loading",
    "quantize_linears",
]
