"""``--kv-transfer-config``: vLLM's JSON, parsed and checked once into ``KVTransferConfig``.

``{"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}`` is the whole of a typical one. Every role
acts per request, as vLLM's P/D connectors do: a request whose ``kv_transfer_params`` says
``do_remote_decode`` keeps its blocks for a decode engine, one that says ``do_remote_prefill`` reads them.
``kv_producer`` refuses the second and ``kv_consumer`` the first, so a misrouted request is a clear 400.

``{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": N}}`` is vLLM's
other spelling of the CPU KV tier (``--kv-offloading-size``); server/config.py turns it into that setting,
so the tier is declared in one place whichever way it was asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pagedserve.common.engine_args import json_object

CONNECTORS = ("MooncakeConnector", "OffloadingConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_SIDE_CHANNEL_PORT = 14579  # vLLM's default kv_port
# A prefill's blocks wait this long for their decode engine to read them (vLLM's NIXL connector waits 480 s
# by default): past it they are freed, and a late reader's transfer fails and is recomputed.
DEFAULT_HOLD_SECONDS = 120.0


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "MooncakeConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # the address peers reach this engine's transfer engine and side channel at
    kv_port: int = DEFAULT_SIDE_CHANNEL_PORT  # the side channel (0: any free port)
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """A config from vLLM's dict or its JSON text (as ``--kv-transfer-config`` gives it)."""
        if isinstance(value, KVTransferConfig):
            return value
        parsed = json_object("kv_transfer_config", value, [f.name for f in fields(cls)])
        return cls(**parsed) if parsed is not None else None

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {CONNECTORS}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number, got {self.kv_port!r}")
        if self.offloads:
            size = self.kv_connector_extra_config.get("cpu_bytes_to_use")
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ValueError("kv_transfer_config: the OffloadingConnector needs kv_connector_extra_config"
                                 f".cpu_bytes_to_use, a byte count > 0, got {size!r}")
        hold = self.kv_connector_extra_config.get("hold_seconds", DEFAULT_HOLD_SECONDS)
        if not isinstance(hold, (int, float)) or hold <= 0:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.hold_seconds must be > 0, "
                             f"got {hold!r}")

    @property
    def offloads(self) -> bool:
        """The CPU KV tier (vLLM's OffloadingConnector), not prefill/decode disaggregation."""
        return self.kv_connector == "OffloadingConnector"

    @property
    def hold_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("hold_seconds", DEFAULT_HOLD_SECONDS))

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
