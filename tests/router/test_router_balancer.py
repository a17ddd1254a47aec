"""The pure routing core: LRU index, CHWBL ring, strategies, load bounds."""

from __future__ import annotations

import math
import random

import pytest
from pagedserve.router.balancer import (
    HASH_RING,
    LEAST_LOAD,
    OVERLOAD_FALLBACK,
    PREFIX_HIT,
    ROUND_ROBIN,
    Balancer,
    HashRing,
    LRUIndex,
)
from pagedserve.router.hashing import block_hashes, seed_hash


def chain(*token_blocks: int, n: int = 8, seed: str = "m") -> list[int]:
    """Hashes of a prompt whose blocks are filled with the given token values."""
    ids = [t for t in token_blocks for _ in range(16)]
    ids += [0] * (16 * n - len(ids)) if len(ids) < 16 * n else []
    return block_hashes(ids, 16, seed_hash(seed))


def keys(n: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.getrandbits(64) for _ in range(n)]


# --- LRU index ----------------------------------------------------------------------------------------
def test_lru_index_stays_within_capacity():
    idx = LRUIndex(100)
    rnd = random.Random(1)
    for _ in range(500):
        idx.insert([rnd.getrandbits(64) for _ in range(rnd.randint(1, 40))])
        assert len(idx) <= 100
    assert len(idx) == 100
    # A prompt longer than the whole capacity keeps its prefix, not its tail.
    long = keys(250, seed=7)
    idx.insert(long)
    assert len(idx) == 100
    assert idx.match(long) == 100


def test_lru_index_match_and_eviction_order():
    idx = LRUIndex(6)
    a = keys(4, seed=1)
    b = keys(4, seed=2)
    idx.insert(a)
    assert idx.match(a) == 4
    assert idx.match(a[:2] + b[:2]) == 2
    assert idx.match(b) == 0
    idx.insert(b)  # 8 blocks into 6 slots: a's tail goes first, a's prefix stays longest
    assert len(idx) == 6
    assert idx.match(b) == 4
    assert idx.match(a) == 2
    assert a[3] not in idx and a[2] not in idx
    idx.insert(a[:1])  # touching a's first block protects it
    idx.insert(keys(4, seed=3))
    assert a[0] in idx
    idx.clear()
    assert len(idx) == 0


def test_lru_index_rejects_zero_capacity():
    with pytest.raises(ValueError):
        LRUIndex(0)


# --- consistent hashing with bounded loads -----------------------------------------------------------
def test_ring_is_deterministic_whatever_the_insertion_order():
    names = [f"http://10.0.0.{i}:8000" for i in range(5)]
    r1, r2 = HashRing(), HashRing()
    for n in names:
        r1.add(n)
    r2.set_members(reversed(names))
    for k in keys(2000):
        assert r1.lookup(k) == r2.lookup(k)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_join_and_leave_move_at_most_one_nth_plus_5_percent(n):
    names = [f"http://10.1.0.{i}:8000" for i in range(n)]
    ks = keys(20_000, seed=n)
    ring = HashRing()
    ring.set_members(names[:-1])
    before = {k: ring.lookup(k) for k in ks}
    ring.add(names[-1])  # join: N-1 -> N
    after = {k: ring.lookup(k) for k in ks}
    moved = sum(before[k] != after[k] for k in ks) / len(ks)
    assert moved <= 1 / n + 0.05, moved
    # Keys only move to the newcomer.
    assert all(after[k] == names[-1] for k in ks if before[k] != after[k])
    ring.remove(names[0])  # leave: N -> N-1
    gone = {k: ring.lookup(k) for k in ks}
    moved = sum(after[k] != gone[k] for k in ks) / len(ks)
    assert moved <= 1 / n + 0.05, moved
    assert all(after[k] == names[0] for k in ks if after[k] != gone[k])


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_chwbl_respects_its_bound(factor):
    names = [f"b{i}" for i in range(4)]
    ring = HashRing()
    ring.set_members(names)
    loads = dict.fromkeys(names, 0.0)
    rnd = random.Random(3)
    # Skewed keys: half the traffic on one key, so plain consistent hashing would pile it up.
    hot = 12345
    for _ in range(2000):
        key = hot if rnd.random() < 0.5 else rnd.getrandbits(64)
        total = sum(loads.values())
        bound = factor * (total + 1) / len(names)
        choice = ring.choose(key, loads, bound)
        assert loads[choice] <= bound
        loads[choice] += 1
        total += 1
        assert max(loads.values()) <= math.ceil(factor * total / len(names)) + 1
        # Random completions keep the fleet busy but bounded.
        if rnd.random() < 0.45:
            busy = [n for n in names if loads[n] > 0]
            loads[rnd.choice(busy)] -= 1


def test_chwbl_prefers_the_owner_when_under_the_bound_and_skips_excluded():
    ring = HashRing()
    ring.set_members(["a", "b", "c"])
    key = 987654321
    owner = ring.lookup(key)
    loads = {"a": 0.0, "b": 0.0, "c": 0.0}
    assert ring.choose(key, loads, 10) == owner
    loads[owner] = 5.0
    second = ring.choose(key, loads, 2)
    assert second != owner
    assert ring.choose(key, loads, 10, exclude={owner}) == second
    assert ring.choose(key, {}, 10) is None


# --- the balancer ---------------------------------------------------------------------------------------
def make(strategy="prefix-hash", n=3, **kw) -> tuple[Balancer, list[str]]:
    kw.setdefault("hash_key_blocks", 1)  # the literal "first block" rule; key_blocks > 1 tested below
    b = Balancer(strategy=strategy, **kw)
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(n)]
    b.set_backends(urls)
    return b, urls


def test_new_prefix_goes_to_its_ring_owner_then_sticks():
    b, _ = make()
    h = chain(1, 2, 3)
    d = b.choose(h)
    assert d.reason == HASH_RING and d.url == b.ring.lookup(h[0])
    b.record(d.url, h)
    # Same prefix, different tail: a prefix hit on the same replica.
    h2 = chain(1, 2, 9)
    d2 = b.choose(h2)
    assert (d2.url, d2.reason, d2.matched_blocks) == (d.url, PREFIX_HIT, 2)
    # Two router replicas agree on a new prefix without sharing state.
    other, _ = make()
    assert other.choose(h).url == d.url


def test_prefix_identity_spans_hash_key_blocks():
    """With a shared template header, new prefixes still spread: the ring key covers 4 blocks."""
    b, _ = make(hash_key_blocks=4, n=4)
    header = (1, 1)  # two blocks every prompt starts with
    tenants = [chain(*header, t, t, t, t) for t in range(2, 30)]
    homes = set()
    for h in tenants:
        d = b.choose(h)
        assert d.reason == HASH_RING and d.url == b.ring.lookup(h[3])
        b.record(d.url, h)
        homes.add(d.url)
    assert len(homes) == 4  # with a first-block key they would all share one replica
    # A match must cover the key blocks to count: 3 shared blocks is not the same prefix...
    d = b.choose(chain(*header, 5, 99, 99, 99))
    assert d.reason == HASH_RING and d.url == b.ring.lookup(chain(*header, 5, 99)[3])
    # ...4 or more is.
    d = b.choose(chain(*header, 9, 9, 9, 42))  # tenants[7] is (1, 1, 9, 9, 9, 9, 0, 0)
    assert d.reason == PREFIX_HIT and d.matched_blocks == 5
    # Prompts shorter than the key: keyed (and matched) on all their full blocks.
    short = chain(7, 8, n=2)
    d = b.choose(short)
    assert d.url == b.ring.lookup(short[1]) and d.reason == HASH_RING
    b.record(d.url, short)
    assert b.choose(short).reason == PREFIX_HIT
    with pytest.raises(ValueError):
        Balancer(hash_key_blocks=0)


def test_longest_match_wins():
    b, urls = make()
    short, long = chain(5, 6), chain(5, 6, 7, 8)
    b.record(urls[0], short[:2])
    b.record(urls[1], long[:4])
    d = b.choose(chain(5, 6, 7, 8, 9))
    assert d.url == urls[1] and d.matched_blocks == 4 and d.reason == PREFIX_HIT


def test_overloaded_replica_is_passed_over():
    b, urls = make(mean_load_factor=1.25)
    h = chain(1, 2, 3)
    b.record(urls[0], h)
    b.record(urls[1], h[:1])
    for _ in range(6):
        b.acquire(urls[0])  # loads 6, 0, 0: bound = 1.25 * 7 / 3 = 2.9
    d = b.choose(h)
    assert d.url == urls[1] and d.reason == OVERLOAD_FALLBACK and d.matched_blocks == 1
    # No other partial match: the bounded ring decides, and never the overloaded replica.
    b2, urls2 = make(mean_load_factor=1.25)
    b2.record(urls2[0], h)
    for _ in range(6):
        b2.acquire(urls2[0])
    d2 = b2.choose(h)
    assert d2.reason == OVERLOAD_FALLBACK and d2.url != urls2[0]
    # Scraped queue depth counts as load too.
    b3, urls3 = make()
    b3.record(urls3[0], h)
    b3.set_scraped(urls3[0], waiting=10, kv_usage=0.9)
    assert b3.choose(h).url != urls3[0]
    # Under the bound the prefix wins even when busier than the others.
    b4, urls4 = make(mean_load_factor=2.0)
    b4.record(urls4[0], h)
    b4.acquire(urls4[0])
    b4.acquire(urls4[1])
    assert b4.choose(h).url == urls4[0]


def test_short_prompts_and_other_routes_go_to_the_least_loaded():
    b, urls = make()
    b.acquire(urls[0])
    b.acquire(urls[1])
    d = b.choose([])
    assert d.reason == LEAST_LOAD and d.url == urls[2]


def test_exclude_and_no_candidates():
    b, urls = make()
    h = chain(4, 4)
    first = b.choose(h).url
    second = b.choose(h, exclude={first}).url
    assert second != first
    third = b.choose(h, exclude={first, second}).url
    assert third not in (first, second)
    assert b.choose(h, exclude=set(urls)) is None
    assert Balancer().choose(h) is None


def test_unhealthy_replica_leaves_the_ring_forgets_its_index_and_rejoins():
    b, _ = make()
    h = chain(8, 8, 8)
    owner = b.choose(h).url
    b.record(owner, h)
    assert b.set_healthy(owner, False)
    assert owner not in b.ring.members and owner not in b.ready_urls()
    assert len(b.backends[owner].index) == 0
    for _ in range(20):
        assert b.choose(h).url != owner
    assert not b.set_healthy(owner, False)  # no change
    assert b.set_healthy(owner, True)
    assert b.choose(h).url == owner  # back as the ring owner of the prefix
    b.set_discovered(owner, False)
    assert owner not in b.ready_urls()
    b.remove_backend(owner)
    assert owner not in b.backends and len(b.ring) == 2


def test_round_robin_cycles_evenly():
    b, urls = make("round-robin")
    seen = [b.choose(chain(1)).url for _ in range(30)]
    assert {u: seen.count(u) for u in urls} == dict.fromkeys(urls, 10)
    assert b.choose(chain(1)).reason == ROUND_ROBIN


def test_least_load_picks_the_least_loaded_and_spreads_ties():
    b, urls = make("least-load")
    b.set_scraped(urls[0], waiting=3, kv_usage=0.5)
    b.acquire(urls[1])
    assert b.choose(chain(1)).url == urls[2]
    b2, urls2 = make("least-load")
    seen = {b2.choose(chain(1)).url for _ in range(6)}
    assert seen == set(urls2)


def test_in_flight_accounting():
    b, urls = make()
    b.acquire(urls[0])
    b.acquire(urls[0])
    b.release(urls[0])
    assert b.backends[urls[0]].in_flight == 1
    b.release(urls[0])
    b.release(urls[0])  # never negative
    assert b.backends[urls[0]].in_flight == 0
    b.release("http://unknown:1")  # a replica removed meanwhile: ignored


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        Balancer(strategy="random")
    with pytest.raises(ValueError):
        Balancer(mean_load_factor=0.5)


# --- hot spots with hundreds of replicas (issue 14, item 9) --------------------------------------------
def test_two_hundred_replicas_keep_affinity_under_the_cap():
    """200 replicas, 100 requests in flight, a quarter of them sharing one hot prefix: the mean-load cap
    alone is 0.63, so every busy owner would spill its prefixes to the next replica on the ring. With
    the floor no replica takes a request above the cap, and repeated prefixes mostly hit."""
    n, in_flight_max, factor, floor = 200, 100, 1.25, 4.0
    rnd = random.Random(1)
    b = Balancer(mean_load_factor=factor, min_load_cap=floor, rng=random.Random(2))
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(n)]
    b.set_backends(urls)
    tenants = [chain(t, t, t, t) for t in range(301)]  # tenant 0 is the hot prefix
    in_flight: list[str] = []
    seen: set[int] = set()
    repeats = hits = 0
    homes: dict[int, set[str]] = {}
    for _ in range(6000):
        if len(in_flight) == in_flight_max:  # a request ends: the simulated load stays bounded
            b.release(in_flight.pop(rnd.randrange(len(in_flight))))
        t = 0 if rnd.random() < 0.25 else rnd.randrange(1, len(tenants))
        hashes = tenants[t] + keys(1, rnd.getrandbits(32))
        loads = {url: s.load for url, s in b.backends.items()}
        cap = max(floor, factor * (sum(loads.values()) + 1) / n)
        d = b.choose(hashes)
        assert loads[d.url] <= cap, (d, loads[d.url], cap)
        if t in seen:
            repeats += 1
            hits += d.reason == PREFIX_HIT
        seen.add(t)
        homes.setdefault(t, set()).add(d.url)
        b.record(d.url, hashes)
        b.acquire(d.url)
        in_flight.append(d.url)
    assert max(s.in_flight for s in b.backends.values()) <= floor + 1
    assert hits / repeats >= 0.95, hits / repeats  # about 0.8 without the floor
    assert len(homes[0]) <= 16, len(homes[0])  # the hot prefix on a few replicas, not dozens
    cold = [len(v) for t, v in homes.items() if t]
    assert sum(cold) / len(cold) <= 1.2  # a cold prefix stays on its owner


def test_equal_candidates_are_chosen_at_random():
    """Equally matched, equally loaded replicas: no fixed favourite (router replicas share no state)."""
    b, urls = make(n=4, min_load_cap=0.0, rng=random.Random(5))
    h = chain(1, 2, 3)
    for url in urls[:3]:
        b.record(url, h)
    assert {b.choose(h).url for _ in range(60)} == set(urls[:3])
    # The ring's least-loaded fallback (a bound no member is under) breaks ties at random too.
    ring = HashRing()
    ring.set_members(["a", "b", "c"])
    loads = {"a": 2.0, "b": 2.0, "c": 3.0}
    rng = random.Random(0)
    assert {ring.choose(7, loads, 1.0, rng=rng) for _ in range(40)} == {"a", "b"}


def test_min_load_cap_is_a_floor_of_the_bound():
    b, urls = make(n=3, min_load_cap=4.0)
    assert b.load_cap([0.0, 0.0, 0.0]) == 4.0
    assert b.load_cap([30.0, 30.0, 30.0]) == pytest.approx(1.25 * 91 / 3)
    h = chain(1, 2, 3)
    b.record(urls[0], h)
    for _ in range(4):  # loads 4, 0, 0: over the mean bound (2.1) but not over the floor
        b.acquire(urls[0])
    assert b.choose(h).url == urls[0]
    b.acquire(urls[0])
    assert b.choose(h).url != urls[0]
    with pytest.raises(ValueError):
        Balancer(min_load_cap=-1)
