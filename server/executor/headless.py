"""A node of a multi-node engine other than the leader: `pagedserve serve --headless --node-rank R` runs
this machine's ranks and no API (vLLM's --headless).

It links to the leader first (server/executor/node_link.py), then spawns its ranks
(server/executor/tp_worker.py), which join the leader's group and do what rank 0 tells them. It stays
until they end: all of them cleanly (the leader's stop command, whose link closes about then) is exit 0;
a rank dying, or the leader gone without stopping them, stops the others and is exit 1, so the pod
restarts and LeaderWorkerSet recreates the group.
"""

from __future__ import annotations

import logging
import signal
import sys
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from pagedserve.server.executor.executor import ranks_spec, resolve_model_and_backend
from pagedserve.server.executor.node_link import connect_to_leader, link_port
from pagedserve.server.executor.tp_driver import spawn_ranks

if TYPE_CHECKING:
    from pagedserve.server.config import EngineConfig

logger = logging.getLogger("pagedserve.tp")

LEADER_WAIT_S = 1800.0  # a node may start long before its leader (image pulls, a large model's download)
STOP_GRACE_S = 10.0
# After the leader's link closes: a stopped leader's ranks are ending too, a killed one's fail at once.
LEADER_GONE_GRACE_S = 5.0


def run_headless(config: EngineConfig) -> int:
    model_path, backend = resolve_model_and_backend(config)
    spec = ranks_spec(config, model_path, backend)
    address, port = config.master_addr, link_port(config.master_port)
    logger.info("node %d of %d: linking to the leader at %s:%d", config.node_rank, config.nnodes, address,
                port)
    link = connect_to_leader(address, port, config.node_rank, LEADER_WAIT_S)
    first = config.node_rank * spec.ranks_per_node
    workers = spawn_ranks(spec, range(first, first + spec.ranks_per_node))
    logger.info("node %d: ranks %d..%d started, pids %s", config.node_rank, first,
                first + spec.ranks_per_node - 1, [w.pid for w in workers])
    # Stopped by the leader (its stop command ends the ranks), by the link's loss, or by a signal here:
    # then the leader is likely stopping too, and its stop command may yet end the ranks cleanly.
    def on_sigterm(*_: object) -> None:
        _stop(workers, "SIGTERM", STOP_GRACE_S)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    return _supervise(workers, link, first)


def _supervise(workers: list[Any], link: Any, first: int) -> int:
    running = {worker.sentinel: (rank, worker) for rank, worker in enumerate(workers, start=first)}
    while running:
        ready = wait([*running, link])
        if link in ready and not link.recv(1):
            return _after_leader(workers)
        for sentinel in [s for s in ready if s in running]:
            rank, worker = running.pop(sentinel)
            worker.join()
            if worker.exitcode != 0:
                _stop(workers, f"rank {rank} (pid {worker.pid}) exited with code {worker.exitcode}")
                return 1
    logger.info("every rank of this node stopped cleanly")
    return 0


def _after_leader(workers: list[Any]) -> int:
    """The leader's link closed: after a clean stop its last command is ending the ranks too (the link
    may close first), so they get a moment; ranks that end cleanly mean exit 0, any other end exit 1."""
    for worker in workers:
        worker.join(LEADER_GONE_GRACE_S)
    if all(worker.exitcode == 0 for worker in workers):
        logger.info("the leader stopped, and every rank of this node with it")
        return 0
    _stop(workers, "the leader's link closed")
    return 1


def _stop(workers: list[Any], why: str, grace_s: float = 0.0) -> None:
    """Each rank still running gets ``grace_s`` to end, then is killed."""
    logger.error("stopping this node's ranks: %s", why)
    for worker in workers:
        worker.join(grace_s)
        if worker.is_alive():
            worker.kill()
            worker.join()
