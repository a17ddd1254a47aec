"""The typed messages between the front end and an engine core in its own process (vLLM V1's
EngineCoreRequest / EngineCoreOutputs): frozen dataclasses, pickled over one duplex pipe
(server/engine/core_client.py, server/engine/core_proc.py). Nothing else crosses: each side owns its
objects, and the core's timestamps travel back inside its outputs (``EngineCoreOutput.metrics``).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.server.engine.core_output import EngineCoreOutput, EngineStats

if TYPE_CHECKING:
    from pagedserve.server.config import EngineConfig
    from pagedserve.server.lora.request import LoRARequest
    from pagedserve.server.request import Request

# ---- front end -> core ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequests:
    requests: list[Request]  # without their grammar matchers: the core makes its own from the params


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class AddLoRA:
    call_id: int  # answered by a Reply of the same id once the adapter is read and registered
    lora: LoRARequest


@dataclass(frozen=True)
class RemoveLoRA:
    lora_int_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- core -> front end ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The core is loaded: the configuration as it resolved it (max_model_len, the backend that runs,
    the served name) and the facts the front end's processor needs."""

    config: EngineConfig
    model_path: str
    vocab_size: int
    loras: list[LoRARequest]
    kv_root_hash: bytes
    stats: EngineStats


@dataclass(frozen=True)
class StartupFailed:
    error: BaseException


@dataclass(frozen=True)
class StepOutputs:
    """One step's outputs (empty: a periodic report while idle), the statistics after it and the KV
    events it recorded; ``failed_ids`` and ``error`` when some of its requests failed (those are aborted
    in the core already)."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    kv_events: list[Any] = field(default_factory=list)
    failed_ids: list[str] = field(default_factory=list)
    error: BaseException | None = None


@dataclass(frozen=True)
class Reply:
    call_id: int
    error: BaseException | None = None


@dataclass(frozen=True)
class Fatal:
    """The core cannot go on (a tensor-parallel rank died); it exits after sending this."""

    message: str


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives a pickle round trip, else a RuntimeError carrying its type and text."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        logging.getLogger("pagedserve.engine").debug("unpicklable error %r", error, exc_info=True)
        return RuntimeError(f"{type(error).__name__}: {error}")
