"""Stopping inside the pod's grace period (terminationGracePeriodSeconds, 60 s in operator/resources.py).

On SIGTERM (server/api/cli.py) the server keeps listening but drains: /health answers 503 at once, so
readiness fails and the router takes the replica out; a new generation request gets a 503, which the
router retries on another replica. Running requests get ``grace_s - margin_s`` to finish; then the
engine aborts what is left and each of those streams ends with an error event (serving_base.observed),
and uvicorn gets ``margin_s`` to close the connections. The whole stop stays within ``grace_s`` plus the
engine thread's last step, where before it could take the grace period twice (uvicorn's graceful
shutdown, then the engine's own wait).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pagedserve.server.engine.protocol import EngineClient

_POLL_S = 0.05


@dataclass
class GracefulStop:
    engine: EngineClient
    grace_s: float
    draining: bool = False
    active: int = 0  # engine requests whose responses are still being written
    _drained: asyncio.Event | None = None

    @property
    def margin_s(self) -> float:
        """What is kept, of the grace period, for aborted streams to end and connections to close."""
        return min(5.0, self.grace_s * 0.25)

    def begin(self) -> None:
        self.draining = True

    async def drain(self) -> None:
        """Wait for running requests (at most ``grace_s - margin_s``), then stop the engine; once."""
        self.begin()
        if self._drained is not None:
            await self._drained.wait()
            return
        self._drained = asyncio.Event()
        deadline = time.monotonic() + max(self.grace_s - self.margin_s, 0.0)
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        await self.engine.shutdown(0)  # aborts what still runs: its streams end with an error event
        self._drained.set()
