"""What rank 0 sends the other ranks: one ``Command`` per model call, pickled over the CPU group.

A step's model inputs travel whole, as the dataclass the runner built (server/worker/model_runner.py
``ModelInputs``): a field added there reaches every rank without a change here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

CommandKind = Literal["forward", "logits", "copy_kv", "kv_budget", "setup", "kv_transfer", "read_kv", "stop"]


@dataclass
class Command:
    """``forward``: run ``inputs`` (on the CPU; each rank moves them to its device). ``logits``: the
    hidden rows ``[shape]`` of ``dtype`` follow as one tensor broadcast; every rank computes its vocab
    slice and gathers it to rank 0. ``kv_budget`` (CUDA, at start): profile and agree on the KV bytes
    (``inputs``: server/executor/tp_worker.py ``KVBudgetRequest``). ``setup``: allocate the KV cache
    (``inputs``: ``RunnerSetup``). ``kv_transfer``: register the cache with a transfer engine on host
    ``inputs`` and gather the layouts. ``read_kv``: read a prefill engine's blocks (``inputs``:
    server/kv_transfer/mooncake_agent.py ``RemoteRead``) and gather the results. ``stop``: leave the loop."""

    kind: CommandKind
    inputs: Any = None
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None


def move_tensors(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in it (dataclass fields, lists, tuples, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: move_tensors(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                   if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_tensors(item, device) for item in obj)
    if isinstance(obj, dict):
        return {key: move_tensors(value, device) for key, value in obj.items()}
    return obj
