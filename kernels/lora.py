"""Batched LoRA shrink/expand on the GPU: for now the torch references (kernels/reference.py states the
contract); the Triton kernels replace them."""

from .reference import lora_expand, lora_shrink

__all__ = ["lora_expand", "lora_shrink"]
