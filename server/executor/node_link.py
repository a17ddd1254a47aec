"""The link between the leader (node 0, the engine process) and each other node of a multi-node engine
(``--nnodes``): one TCP connection per node, held open for the engine's life, at ``--master-port`` + 1.

Local ranks are watched through their process sentinels (server/executor/tp_driver.py); a rank on another
machine has none, and a collective with a dead peer fails only when it next runs. So each node's
headless process (server/executor/headless.py) connects here before it starts its ranks, and the
leader's watcher waits on these sockets beside the sentinels: a node whose process ends closes its socket,
and the engine stops at once, naming the node. Each side also learns of the other's end: a headless node
whose leader is gone stops its ranks.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.server.executor.tp_worker import WorkerSpec

logger = logging.getLogger("pagedserve.tp")

ACCEPT_TIMEOUT_S = 1800.0  # as long as the group's own join may take (tp_driver.TIMEOUT_S)
CONNECT_RETRY_S = 0.5


def link_port(master_port: int) -> int:
    """The leader's port for the nodes' links: the one after the group's (0: one node, no links)."""
    return master_port + 1 if master_port else 0


class NodeLinks:
    """The leader's side: a listening socket, and each node's accepted link, by node rank."""

    def __init__(self, port: int, nnodes: int) -> None:
        self.nnodes = nnodes
        self.sockets: dict[socket.socket, int] = {}
        self._listener = socket.create_server(("", port), reuse_port=False)
        self._accepted = threading.Event()
        threading.Thread(target=self._accept, name="node-links", daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed by close(): the engine stopped while nodes joined
            while len(self.sockets) < self.nnodes - 1:
                sock, address = self._listener.accept()
                node = int.from_bytes(sock.recv(4), "big")
                self.sockets[sock] = node
                logger.info("node %d linked from %s", node, address[0])
        self._accepted.set()

    def wait_all(self, timeout_s: float = ACCEPT_TIMEOUT_S) -> None:
        """Every node linked (each links before its ranks join the group, so after the join this is
        at once); RuntimeError after ``timeout_s``."""
        if not self._accepted.wait(timeout_s):
            raise RuntimeError(f"{self.nnodes - 1 - len(self.sockets)} node(s) never linked to the leader")

    def lost_message(self, node: int, spec: WorkerSpec) -> str:
        first = node * spec.ranks_per_node
        return (f"node {node} (ranks {first}..{first + spec.ranks_per_node - 1}) lost its link to the "
                "leader: its process ended")

    def wait_closed(self, timeout_s: float) -> None:
        """Until every node's link has closed (its process ended: nodes send nothing else), or
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.sockets)
        while pending and (left := deadline - time.monotonic()) > 0:
            for sock in wait(pending, left):
                pending.remove(sock)

    def close(self) -> None:
        for sock in [self._listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.close()


def connect_to_leader(address: str, port: int, node: int, timeout_s: float) -> socket.socket:
    """A node's side: its link to the leader, retried until the leader listens (it may start later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=CONNECT_RETRY_S * 4)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader at {address}:{port} after {timeout_s:.0f} s") from None
            time.sleep(CONNECT_RETRY_S)
            continue
        sock.settimeout(None)
        sock.sendall(node.to_bytes(4, "big"))
        return sock
