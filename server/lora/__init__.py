"""Many LoRA adapters on one base model (vLLM's LoRA support, Punica / S-LoRA batching).

- request.py: ``LoRARequest`` (what a request names) and ``LoRAModulePath`` (``--lora-modules``).
- peft.py: reading and checking a PEFT adapter folder into the layers' stacked, block-diagonal form.
- layers.py: the LoRA state a ``Linear`` carries (``max_loras`` slots) and the per-step token mapping.
- manager.py: resident adapters: the registered ones, a CPU LRU cache, device slots with LRU eviction.

The kernels are ``backend.kernels.lora_shrink`` / ``lora_expand`` (kernels/reference.py holds the spec).
"""

from pagedserve.server.lora_request import LoRALoadError, LoRAModulePath, LoRARequest

__all__ = ["LoRALoadError", "LoRAModulePath", "LoRARequest"]
