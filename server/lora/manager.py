"""Which adapters the engine knows, which sit in CPU memory and which in the device slots.

- Registered adapters (``--lora-modules``, ``/v1/load_lora_adapter``, ``LLM.generate(lora_request=)``):
  checked and read once at registration (``load``, off the engine thread in the server).
- A CPU cache of up to ``max_cpu_loras`` read adapters, least recently used out first; an adapter
  dropped from it is read again from its path when a request needs it (vLLM's LRUCacheLoRAModelManager).
- ``max_loras`` device slots in every LoRA layer (server/lora/layers.py). ``activate`` gives each adapter
  of a step a slot: the one it has, a free one, or the least recently used slot whose adapter no running
  request uses. The scheduler admits no more distinct adapters than slots (server/core/scheduler.py), so
  such a slot always exists and no request is ever dropped for want of one.

Unloading an adapter stops new requests at once; requests already running keep its slot and finish
with it; waiting ones fail (server/engine/core.py ``_fail_unloaded``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch
from pagedserve.server.layers.linear import Linear
from pagedserve.server.lora.layers import LinearLoRA, LoRAMapping
from pagedserve.server.lora.peft import AdapterWeights, LoRAModelInfo, LoRATarget, load_peft_adapter
from pagedserve.server.lora_request import LoRALoadError, LoRARequest
from torch import nn

logger = logging.getLogger("pagedserve.engine")


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.mapping = LoRAMapping()
        self.layers: dict[str, LinearLoRA] = {}
        for path, linear in lora_linears(model):
            linear.lora = LinearLoRA(linear.in_features, linear.output_sizes, max_loras, max_lora_rank,
                                     model.backend.kernels, self.mapping, model.dtype, model.device)
            self.layers[path] = linear.lora
        self.info = LoRAModelInfo(
            targets={p: LoRATarget(la.in_features, tuple(la.output_sizes)) for p, la in self.layers.items()},
            route=lambda module: _route(model, module),
            module_names=frozenset(_module_names(model, self.layers)),
            max_lora_rank=max_lora_rank,
            dtype=model.dtype,
        )
        self.registered: dict[int, LoRARequest] = {}
        self.cpu_cache: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.slots: list[int | None] = [None] * max_loras  # the lora_int_id in each device slot
        self.slot_used: list[int] = [0] * max_loras  # the step that last used each slot
        self.num_steps = 0

    # ---- registration (the engine thread, or the offline engine's one thread) -----------------------

    def load(self, lora: LoRARequest) -> AdapterWeights:
        """Read and check an adapter; touches no engine state, so the server calls it off the loop."""
        return load_peft_adapter(lora, self.info)

    def add(self, lora: LoRARequest, weights: AdapterWeights | None = None) -> None:
        if weights is None:
            weights = self.load(lora)
        self.registered[lora.lora_int_id] = lora
        self._cache(lora.lora_int_id, weights)
        if lora.lora_int_id in self.slots:  # the same id again, maybe new weights: refresh its slot
            self._fill(self.slots.index(lora.lora_int_id), weights)

    def remove(self, lora_int_id: int) -> None:
        """New requests can no longer use it; a slot it holds stays for running requests until reused."""
        self.registered.pop(lora_int_id, None)
        self.cpu_cache.pop(lora_int_id, None)

    def is_usable(self, lora_int_id: int) -> bool:
        return lora_int_id in self.registered or lora_int_id in self.slots

    # ---- per step ----------------------------------------------------------------------------------

    def activate(self, step_ids: Iterable[int], pinned: set[int]) -> dict[int, int]:
        """A slot for each adapter of the step (lora_int_id -> slot); ``pinned``: the adapters of every
        running request, whose slots are not taken away."""
        self.num_steps += 1
        slot_of: dict[int, int] = {}
        for lora_id in step_ids:
            if lora_id in slot_of:
                continue
            if lora_id in self.slots:
                slot = self.slots.index(lora_id)
            else:
                slot = self._free_slot(pinned | set(slot_of))
            if self.slots[slot] != lora_id:
                self._fill(slot, self._weights(lora_id))
                self.slots[slot] = lora_id
            self.slot_used[slot] = self.num_steps
            slot_of[lora_id] = slot
        return slot_of

    def set_token_slots(self, token_slots: torch.Tensor | None) -> None:
        self.mapping.token_slots = token_slots

    def _free_slot(self, keep: set[int]) -> int:
        candidates = [i for i, lora_id in enumerate(self.slots) if lora_id is None or lora_id not in keep]
        if not candidates:  # the scheduler's max_loras rule makes this unreachable
            raise RuntimeError(f"more adapters in one step than max_loras ({self.max_loras})")
        return min(candidates, key=lambda i: (self.slots[i] is not None, self.slot_used[i]))

    def _weights(self, lora_id: int) -> AdapterWeights:
        weights = self.cpu_cache.get(lora_id)
        if weights is not None:
            self.cpu_cache.move_to_end(lora_id)
            return weights
        lora = self.registered.get(lora_id)
        if lora is None:
            raise LoRALoadError(f"LoRA adapter {lora_id} was unloaded")
        logger.info("reading LoRA adapter %s again (not in the CPU cache of %d)", lora.lora_name,
                    self.max_cpu_loras)
        weights = self.load(lora)
        self._cache(lora_id, weights)
        return weights

    def _cache(self, lora_id: int, weights: AdapterWeights) -> None:
        self.cpu_cache[lora_id] = weights
        self.cpu_cache.move_to_end(lora_id)
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)

    def _fill(self, slot: int, weights: AdapterWeights) -> None:
        for path, layer in self.layers.items():
            layer.set_slot(slot, weights.get(path))


def lora_linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """The decoder layers' projections LoRA applies to (the family's ``lora_modules``)."""
    names = set(model.lora_modules)
    return [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, Linear) and path.rpartition(".")[2] in names and ".layers." in f".{path}"
    ]


def _route(model: nn.Module, module: str) -> tuple[str, int | None]:
    """A checkpoint module path (``model.layers.0.self_attn.q_proj``) -> our module path and slice."""
    path, _, shard = model.route_weight(module + ".weight")
    return path, shard


def _module_names(model: nn.Module, layers: dict[str, LinearLoRA]) -> set[str]:
    """The checkpoint module names an adapter may target: ours, and those stacked into ours."""
    ours = {path.rpartition(".")[2] for path in layers}
    stacked = {original for merged, original, _ in model.stacked_params if merged in ours}
    return ours | stacked
