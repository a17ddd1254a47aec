"""Routing decisions, pure: strategies, the CHWBL ring, the per-replica LRU index of block hashes and
load scoring. No I/O, no clocks, no asyncio: everything here is driven by the proxy and discovery and
tested directly.

Load of a replica = the router's own in-flight requests to it + its scraped ``vllm:num_requests_waiting``
+ its scraped ``vllm:kv_cache_usage_perc`` (0..1). A replica is *overloaded* for a new request when its
load exceeds the cap: ``mean_load_factor`` x the mean load of the candidates counting the new request
(``factor * (sum(loads) + 1) / n``, the bound of consistent hashing with bounded loads), but never less
than ``min_load_cap``. With a factor >= 1 at least one candidate is always under the cap.

Why the floor: with hundreds of replicas the mean is tiny (100 requests over 200 replicas: a cap of
0.63), so a replica holding one request is already "overloaded" and every prefix whose owner is busy
spills to the next replica on the ring, which computes the prefix again; a popular prefix ends up on
dozens of replicas (KubeAI met this with hundreds of vLLM replicas, kubeai-project/kubeai PR 519). An
engine batches a few more requests at almost no cost, so a replica under ``min_load_cap`` keeps its
prefixes. Ties between equally good candidates are broken at random: router replicas share no state,
and a fixed order (the URL) would send all of them to the same replica at the same moment.

``prefix-hash`` (default): the candidate whose index holds the longest prefix of the request's block
hashes wins (ties: lower load), unless it is overloaded; then the next-longest match under the bound,
else the CHWBL ring. No match: the CHWBL ring keyed by the prefix's hash (reason ``hash_ring``), so
every router replica sends a new prefix to the same replica without sharing state. A prompt shorter
than one block has nothing to match: least load.

``kv-events``: as prefix-hash, but a replica whose engine streams its KV events (router/kv_index.py)
is matched on what it really holds (``kv_matches``, from the proxy), not on the router's guess; the
others keep their guessed index. A winner matched on real blocks is reason ``kv_event_hit``.

The ring key is the chained hash of the first ``hash_key_blocks`` blocks (or of all full blocks, for a
shorter prompt), and a match only counts as a prefix hit when it covers at least those blocks. With
``hash_key_blocks=1`` that is "the first block" literally; the default, 4 blocks (64 tokens at block size
16), exists because real chat templates open every conversation with the same tokens (Llama 3.1's
system header with its knowledge and today's dates is about 30 tokens): keyed on the first block alone,
every new prefix would land on one replica and spread only by overflowing its load bound.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from pagedserve.common.routing import STRATEGIES
from pagedserve.router.adapters import ServedModels, adapter_names

# Decision reasons (the `reason` label of pagedserve_router_routing_decisions_total).
PREFIX_HIT = "prefix_hit"
HASH_RING = "hash_ring"
OVERLOAD_FALLBACK = "overload_fallback"
LEAST_LOAD = "least_load"
ROUND_ROBIN = "round_robin"
KV_EVENT_HIT = "kv_event_hit"
REASONS = (PREFIX_HIT, HASH_RING, OVERLOAD_FALLBACK, LEAST_LOAD, ROUND_ROBIN, KV_EVENT_HIT)


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class LRUIndex:
    """A bounded set of block hashes with least-recently-used eviction."""

    __slots__ = ("_d", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._d: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: int) -> bool:
        return h in self._d

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading hashes present (the matched prefix, in blocks)."""
        d = self._d
        n = 0
        for h in hashes:
            if h not in d:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Record a prompt's blocks. The first blocks end up most recent, so a chain is evicted from its
        tail first, as the engine does, and a long prompt over capacity keeps its prefix."""
        d = self._d
        for h in reversed(hashes[: self.capacity]):
            if h in d:
                d.move_to_end(h)
            else:
                d[h] = None
        while len(d) > self.capacity:
            d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()


class HashRing:
    """Consistent hashing with bounded loads (CHWBL): each member has ``virtual_nodes`` points on a
    64-bit ring, placed by a hash of its name, so every router replica builds the same ring."""

    def __init__(self, virtual_nodes: int = 160) -> None:
        if virtual_nodes <= 0:
            raise ValueError("virtual_nodes must be positive")
        self.virtual_nodes = virtual_nodes
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def add(self, name: str) -> None:
        if name not in self._members:
            self._members.add(name)
            self._rebuild()

    def remove(self, name: str) -> None:
        if name in self._members:
            self._members.discard(name)
            self._rebuild()

    def set_members(self, names: Iterable[str]) -> None:
        names = set(names)
        if names != self._members:
            self._members = names
            self._rebuild()

    def _rebuild(self) -> None:
        pts = []
        for name in self._members:
            base = name.encode()
            for i in range(self.virtual_nodes):
                pts.append((_h64(base + b"#" + str(i).encode()), name))
        pts.sort()
        self._points = [p for p, _ in pts]
        self._owners = [o for _, o in pts]

    def walk(self, key: int) -> Iterable[str]:
        """Distinct members clockwise from ``key``."""
        n = len(self._points)
        if n == 0:
            return
        start = bisect.bisect_left(self._points, key & 0xFFFFFFFFFFFFFFFF)
        seen: set[str] = set()
        owners = self._owners
        for i in range(n):
            owner = owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._members):
                    return

    def lookup(self, key: int) -> str | None:
        """The key's owner, ignoring load."""
        return next(iter(self.walk(key)), None)

    def choose(
        self,
        key: int,
        loads: dict[str, float],
        bound: float,
        exclude: Iterable[str] = (),
        rng: random.Random | None = None,
    ) -> str | None:
        """The first member clockwise from ``key`` among ``loads``' keys (minus ``exclude``) whose load
        is at most ``bound``; if none is (only possible for bounds below the mean), the least loaded
        (ties at random)."""
        excluded = set(exclude)
        for owner in self.walk(key):
            if owner in excluded or owner not in loads:
                continue
            if loads[owner] <= bound:
                return owner
        rest = {name: load for name, load in loads.items() if name not in excluded and name in self._members}
        return least_loaded(rest, rng or random) if rest else None


def least_loaded(loads: dict[str, float], rng: random.Random) -> str:
    """The key of the smallest load; equal loads are broken at random (``loads`` must not be empty)."""
    low = min(loads.values())
    return rng.choice([name for name, load in loads.items() if load == low])


class BackendState:
    """What the balancer knows of one replica."""

    __slots__ = (
        "discovered", "healthy", "in_flight", "index", "instance", "kv_usage", "models", "url", "waiting"
    )  # fmt: skip

    def __init__(self, url: str, index_capacity: int) -> None:
        self.url = url
        self.discovered = True  # ready according to discovery (EndpointSlice conditions; static: True)
        self.healthy = True  # the router's own health checks and failed connections
        self.in_flight = 0
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.index = LRUIndex(index_capacity)
        self.instance: str | None = None  # its engine's instance (/health), in the response ids it makes
        self.models: ServedModels | None = None  # its /v1/models (router/adapters.py); None: not read yet

    @property
    def ready(self) -> bool:
        return self.discovered and self.healthy

    @property
    def load(self) -> float:
        return self.in_flight + self.waiting + self.kv_usage


class Decision:
    __slots__ = ("matched_blocks", "reason", "url")

    def __init__(self, url: str, reason: str, matched_blocks: int = 0) -> None:
        self.url = url
        self.reason = reason
        self.matched_blocks = matched_blocks

    def __repr__(self) -> str:
        return f"Decision({self.url!r}, {self.reason!r}, matched_blocks={self.matched_blocks})"


class Balancer:
    """The replicas, their state, and the choice of one for each request."""

    def __init__(
        self,
        strategy: str = "prefix-hash",
        mean_load_factor: float = 1.25,
        index_capacity: int = 100_000,
        virtual_nodes: int = 160,
        hash_key_blocks: int = 4,
        min_load_cap: float = 4.0,
        rng: random.Random | None = None,
    ) -> None:
        if hash_key_blocks < 1:
            raise ValueError("hash_key_blocks must be >= 1")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if mean_load_factor < 1.0:
            raise ValueError("mean_load_factor must be >= 1.0")
        if min_load_cap < 0:
            raise ValueError("min_load_cap must be >= 0")
        self.strategy = strategy
        self.mean_load_factor = mean_load_factor
        self.min_load_cap = min_load_cap
        self.rng = rng or random.Random()  # tie-breaks; tests pass a seeded one
        self.index_capacity = index_capacity
        self.hash_key_blocks = hash_key_blocks
        self.backends: dict[str, BackendState] = {}
        self.ring = HashRing(virtual_nodes)
        # Round-robin and least-load rotation start at a random offset, so that router replicas started
        # together do not walk the fleet in step.
        self._rr = self.rng.randrange(1 << 16)
        self._adapter_names: frozenset[str] | None = None

    # --- membership ------------------------------------------------------------------------------
    def set_backends(self, urls: Iterable[str]) -> None:
        """The full set of discovered replicas (discovery readiness set separately)."""
        urls = list(dict.fromkeys(urls))
        for url in list(self.backends):
            if url not in urls:
                del self.backends[url]
        for url in urls:
            if url not in self.backends:
                self.backends[url] = BackendState(url, self.index_capacity)
        self._sync_ring()

    def add_backend(self, url: str, discovered: bool = True) -> BackendState:
        state = self.backends.get(url)
        if state is None:
            state = self.backends[url] = BackendState(url, self.index_capacity)
        state.discovered = discovered
        self._sync_ring()
        return state

    def remove_backend(self, url: str) -> None:
        if self.backends.pop(url, None) is not None:
            self._sync_ring()

    def set_discovered(self, url: str, ready: bool) -> None:
        state = self.backends.get(url)
        if state is not None and state.discovered != ready:
            state.discovered = ready
            self._sync_ring()

    def set_healthy(self, url: str, healthy: bool) -> bool:
        """Returns True if the replica's readiness changed."""
        state = self.backends.get(url)
        if state is None or state.healthy == healthy:
            return False
        state.healthy = healthy
        self._sync_ring()
        return True

    def _sync_ring(self) -> None:
        self._adapter_names = None  # a replica came or went: its adapters with it
        ready = {url for url, s in self.backends.items() if s.ready}
        for url, s in self.backends.items():
            # A replica that left the ring lost (or will lose, on restart) its cache: forget its index.
            if url not in ready and url in self.ring.members:
                s.index.clear()
        self.ring.set_members(ready)

    def ready_urls(self) -> list[str]:
        return [url for url, s in self.backends.items() if s.ready]

    # --- load ------------------------------------------------------------------------------------
    def set_scraped(self, url: str, waiting: float, kv_usage: float) -> None:
        state = self.backends.get(url)
        if state is not None:
            state.waiting = max(0.0, float(waiting))
            state.kv_usage = min(1.0, max(0.0, float(kv_usage)))

    def set_models(self, url: str, models: ServedModels | None) -> None:
        state = self.backends.get(url)
        if state is not None and state.models != models:
            state.models = models
            self._adapter_names = None

    def set_instance(self, url: str, instance: str | None) -> None:
        state = self.backends.get(url)
        if state is not None and instance:
            state.instance = instance

    def url_of_instance(self, instance: str) -> str | None:
        """The replica whose engine is ``instance`` (it stores that instance's responses)."""
        return next((url for url, s in self.backends.items() if s.instance == instance), None)

    def adapter_names(self) -> frozenset[str]:
        """Every LoRA adapter some replica lists (cached until a list changes or a replica goes)."""
        if self._adapter_names is None:
            self._adapter_names = adapter_names(s.models for s in self.backends.values())
        return self._adapter_names

    def acquire(self, url: str) -> None:
        state = self.backends.get(url)
        if state is not None:
            state.in_flight += 1

    def release(self, url: str) -> None:
        state = self.backends.get(url)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def record(self, url: str, hashes: Sequence[int]) -> None:
        """Remember that ``hashes`` were sent to ``url`` (its engine will cache those blocks)."""
        state = self.backends.get(url)
        if state is not None and hashes:
            state.index.insert(hashes)

    # --- choice ----------------------------------------------------------------------------------
    def choose(
        self,
        hashes: Sequence[int] = (),
        exclude: Iterable[str] = (),
        kv_matches: dict[str, int] | None = None,
        only: Collection[str] | None = None,
    ) -> Decision | None:
        """The replica for a request with these block hashes, avoiding ``exclude`` (replicas already
        tried). ``kv_matches``: {url: leading blocks its engine reports holding}, for the replicas whose
        KV events are synchronised (kv-events); they override the guessed index. ``only``: the replicas
        allowed at all (those holding the request's LoRA adapter); the load bound is theirs. None when no
        ready replica is left."""
        kv_matches = kv_matches or {}
        excluded = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        cands = [
            s
            for s in self.backends.values()
            if s.ready and s.url not in excluded and (only is None or s.url in only)
        ]
        if not cands:
            return None
        if self.strategy == "round-robin":
            if len(cands) > 1:
                cands.sort(key=lambda s: s.url)
            self._rr += 1
            return Decision(cands[self._rr % len(cands)].url, ROUND_ROBIN)
        if self.strategy == "least-load" or not hashes:
            return Decision(self._least_loaded(cands).url, LEAST_LOAD)

        key_len = min(self.hash_key_blocks, len(hashes))
        key = hashes[key_len - 1]

        def match(s: BackendState) -> int:
            real = kv_matches.get(s.url)
            return s.index.match(hashes) if real is None else real

        def hit(s: BackendState) -> str:
            return KV_EVENT_HIT if s.url in kv_matches else PREFIX_HIT

        if len(cands) == 1:
            only = cands[0]
            matched = match(only)
            return Decision(only.url, hit(only) if matched >= key_len else HASH_RING, matched)

        loads = {s.url: s.load for s in cands}
        bound = self.load_cap(loads.values())
        matches = [(match(s), s) for s in cands]
        best_len = max(m for m, _ in matches)
        if best_len >= key_len:
            # Longest match first; equal matches: lower load; equal loads: at random.
            tie = {s.url: self.rng.random() for _, s in matches}
            matches.sort(key=lambda ms: (-ms[0], loads[ms[1].url], tie[ms[1].url]))
            top = matches[0][1]
            if loads[top.url] <= bound:
                return Decision(top.url, hit(top), best_len)
            for m, s in matches[1:]:
                if m < key_len:
                    break
                if loads[s.url] <= bound:
                    return Decision(s.url, OVERLOAD_FALLBACK, m)
        url = self.ring.choose(key, loads, bound, excluded, self.rng)
        if url is None:  # pragma: no cover - cands are ring members
            url = self._least_loaded(cands).url
        matched = match(self.backends[url])
        if best_len >= key_len:  # the replicas holding the prefix were all over the bound
            return Decision(url, OVERLOAD_FALLBACK, matched)
        owner = next((o for o in self.ring.walk(key) if o not in excluded and o in loads), url)
        return Decision(url, HASH_RING if url == owner else OVERLOAD_FALLBACK, matched)

    def load_cap(self, loads: Iterable[float]) -> float:
        """The most load a candidate may carry and still take a new request (see the module docstring)."""
        loads = list(loads)
        return max(self.min_load_cap, self.mean_load_factor * (sum(loads) + 1.0) / len(loads))

    def _least_loaded(self, cands: list[BackendState]) -> BackendState:
        # Ties are broken by rotation so that an idle fleet is not all sent to one replica.
        self._rr += 1
        n = len(cands)
        start = self._rr % n
        best = cands[start]
        for i in range(1, n):
            s = cands[(start + i) % n]
            if s.load < best.load:
                best = s
        return best
