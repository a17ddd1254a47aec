"""Scale from zero at the router: hold requests while no engine replica is ready, and wake one.

Holding (``--max-held-requests N`` > 0): a request that finds no ready replica waits in a FIFO queue of at
most N requests, each for at most ``--held-request-timeout`` seconds; when a replica becomes ready
(``on_ready``, called on every membership change in router/proxy.py) every held request is released in
arrival order and routed as usual. A full queue or a timeout answers 503 with ``Retry-After`` and the
OpenAI error JSON (common/errors.py); a held request whose client leaves is cancelled by the proxy's
disconnect watch (common/disconnect.py) and leaves the queue. While holding is on, the router counts
itself ready (``/ready``) whenever it can still hold: with 0 engines it must stay behind its Service, or
no request could ever reach it to wake them.

Waking (``--scale-from-zero NAME``, with router/scaler.py): the first held request records activity on
the ModelDeployment, then sets its scale subresource from 0 to 1 (one wake call at a time, at most one a
second; each new held request, and every activity interval while any is held, tries again, in case the
scale went back to 0). Activity: the ``pagedserve.io/last-request-time`` annotation, written at most
once per ``--activity-interval`` while requests arrive, and every interval while any is in flight or
held, so the operator (operator/idle.py) never scales down under a request, however long it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from pagedserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

WAKE_INTERVAL_S = 1.0  # at most one wake call (a read, two writes) per second, however many arrive


class HeldRequestRefused(Exception):
    """A request the queue could not take (full) or that waited too long (timeout)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Activator:
    def __init__(
        self,
        metrics: RouterMetrics,
        max_held: int = 0,
        held_timeout: float = 300.0,
        scaler: Any = None,
        activity_interval: float = 10.0,
    ) -> None:
        """``scaler``: router/scaler.py's ModelDeploymentScaler (None: hold only, wake nobody)."""
        self.metrics = metrics
        self.max_held = max_held
        self.held_timeout = held_timeout
        self.scaler = scaler
        self.activity_interval = activity_interval
        self.active = 0  # requests between arrival and end: in flight or held
        self._held: deque[asyncio.Future[None]] = deque()
        self._first_held_at: float | None = None  # monotonic, for the wake-up time
        self._wake_task: asyncio.Task[None] | None = None
        self._woken_at = float("-inf")  # monotonic, the last wake call
        self._last_request: float = 0.0  # Unix time of the last arrival
        self._reported: float = 0.0  # the last time written to the annotation
        self._reported_at: float = float("-inf")  # monotonic, when it was written
        self._nudge = asyncio.Event()
        self._report_task: asyncio.Task[None] | None = None
        metrics.max_held.set(max_held)

    @property
    def holding(self) -> bool:
        return self.max_held > 0

    @property
    def held(self) -> int:
        return len(self._held)

    def can_hold(self) -> bool:
        return self.holding and len(self._held) < self.max_held

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self.scaler is not None and self._report_task is None:
            self._report_task = asyncio.get_running_loop().create_task(self._report_loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._report_task, self._wake_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- per request -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Around a whole request: counts it active and records its arrival for the annotation."""
        self.active += 1
        self._last_request = time.time()
        if time.monotonic() - self._reported_at >= self.activity_interval:
            self._nudge.set()  # the first request after a quiet interval is recorded at once
        try:
            yield
        finally:
            self.active -= 1

    async def wait_for_ready(self) -> None:
        """Hold until a replica is ready (on_ready); HeldRequestRefused when full or timed out."""
        if not self.can_hold():
            self.metrics.held_refused.inc()
            raise HeldRequestRefused(
                f"no engine replica is ready and {self.max_held} requests are already waiting for one",
                retry_after=max(1, round(min(self.held_timeout, 30))),
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.append(waiter)
        if self._first_held_at is None:
            self._first_held_at = time.monotonic()
        self.metrics.held.inc()
        self.metrics.held_total.inc()
        self.wake()
        try:
            await asyncio.wait_for(waiter, self.held_timeout)
        except asyncio.TimeoutError:
            self.metrics.held_timeouts.inc()
            raise HeldRequestRefused(
                f"no engine replica became ready within {self.held_timeout:g}s",
                retry_after=max(1, round(min(self.held_timeout, 30))),
            ) from None
        finally:
            self.metrics.held.dec()
            with contextlib.suppress(ValueError):
                self._held.remove(waiter)  # timed out or its client left (the proxy cancelled it)
            if not self._held and not waiter.done():
                self._first_held_at = None  # nobody waits any more: the next wake-up starts afresh

    def on_ready(self, ready: int) -> None:
        """Membership changed: with a ready replica, release every held request in arrival order."""
        if ready <= 0 or not self._held:
            return
        if self._first_held_at is not None:
            self.metrics.wake_up_seconds.observe(time.monotonic() - self._first_held_at)
            self._first_held_at = None
        while self._held:
            waiter = self._held.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # --- the ModelDeployment ---------------------------------------------------------------------
    def wake(self) -> None:
        if self.scaler is None or (self._wake_task is not None and not self._wake_task.done()):
            return
        if time.monotonic() - self._woken_at < WAKE_INTERVAL_S:
            return
        self._woken_at = time.monotonic()
        self._wake_task = asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        assert self.scaler is not None
        try:
            # Activity first: the operator must not see 1 replica with an old annotation and undo it.
            await self._report(time.time())
            if await self.scaler.wake():
                self.metrics.wake_ups.inc()
        except Exception as exc:  # the next held request tries again
            logger.warning("could not wake the engines: %s", exc)

    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._nudge.wait(), self.activity_interval)
            self._nudge.clear()
            if self._held:
                self.wake()  # still waiting: again, in case the scale went back to 0 since the last wake
            when = time.time() if self.active else self._last_request
            if when <= self._reported:
                continue
            try:
                await self._report(when)
            except Exception as exc:  # the next interval tries again
                logger.warning("could not record activity on the ModelDeployment: %s", exc)

    async def _report(self, when: float) -> None:
        assert self.scaler is not None
        await self.scaler.record_activity(when)
        self._reported = max(self._reported, when)
        self._reported_at = time.monotonic()
