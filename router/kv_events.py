"""One subscription per replica to its engine's KV events (``GET /v1/kv_events``, newline-delimited
JSON, server/core/kv_events.py), feeding router/kv_index.py for ``--strategy kv-events``.

Each subscription starts with the engine's snapshot, so a router that (re)starts rebuilds its index
from it. A stream that ends (engine restart, a subscriber the engine dropped for being slow, a network
cut), a heartbeat that does not come, or a batch whose ``seq`` is not the next one drops the replica's
entries and counts a resync; the subscription is made again after ``retry_delay`` (doubling up to
``max_retry_delay`` while it keeps failing). Meanwhile the balancer routes that replica by prefix-hash:
routing degrades, it never fails. An engine without ``--enable-kv-events`` answers 404 and is retried
at the longest delay.

The tasks run on the router's event loop, as the balancer is only touched there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable

import httpx
from pagedserve.router.kv_index import GapError, KVIndex

logger = logging.getLogger(__name__)

EVENTS_PATH = "/v1/kv_events"
HEARTBEAT_TIMEOUT_S = 20.0  # the engine sends a line at least every 5 s (server/core/kv_events.py)


class KVEventSubscriptions:
    def __init__(
        self,
        index: KVIndex,
        client: httpx.AsyncClient,
        api_key: str | None = None,
        retry_delay: float = 0.5,
        max_retry_delay: float = 10.0,
        on_batch: Callable[[str, int], None] | None = None,
        on_resync: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_batch(url, events)`` after each applied batch; ``on_resync(url, reason)`` when a
        replica's entries are dropped (reason: ``stream_end``, ``gap``, ``error``)."""
        self.index = index
        self.client = client
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self.on_batch = on_batch or (lambda url, n: None)
        self.on_resync = on_resync or (lambda url, reason: None)
        self._tasks: dict[str, asyncio.Task] = {}

    def sync(self, urls: Iterable[str]) -> None:
        """A subscription for every replica in ``urls``; those of the others end (their entries go)."""
        urls = set(urls)
        for url in [u for u in self._tasks if u not in urls]:
            self._tasks.pop(url).cancel()
            self.index.drop(url)
        loop = asyncio.get_running_loop()
        for url in urls - set(self._tasks):
            self._tasks[url] = loop.create_task(self._run(url), name=f"kv-events {url}")

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, url: str) -> None:
        delay = self.retry_delay
        while True:
            try:
                reason = await self._follow(url)
            except asyncio.CancelledError:
                self.index.drop(url)
                raise
            except GapError as exc:
                logger.info("KV events of %s: %s; resynchronising", url, exc)
                self.on_resync(url, "gap")  # the index dropped the replica already
                reason = None
                delay = self.retry_delay
            except _Unavailable as exc:
                logger.debug("KV events of %s unavailable: %s", url, exc)
                reason, delay = None, self.max_retry_delay
            except (httpx.HTTPError, OSError, ValueError, asyncio.TimeoutError) as exc:
                logger.debug("KV events of %s: %r", url, exc)
                reason = "error"
            was_synced = self.index.synced(url)
            self.index.drop(url)
            if was_synced and reason is not None:
                self.on_resync(url, reason)
            if was_synced:
                delay = self.retry_delay  # it was serving events: resubscribe soon
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_retry_delay)

    async def _follow(self, url: str) -> str:
        """Follow one subscription until it ends; returns why (``stream_end``)."""
        timeout = httpx.Timeout(HEARTBEAT_TIMEOUT_S, connect=5.0)
        async with self.client.stream("GET", url + EVENTS_PATH, headers=self.headers, timeout=timeout) as r:
            if r.status_code != 200:
                raise _Unavailable(f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.strip():
                    continue  # heartbeat
                n = self.index.apply(url, json.loads(line))
                self.on_batch(url, n)
        return "stream_end"


class _Unavailable(Exception):
    """The engine does not serve KV events (404: off) or refused the subscription."""
