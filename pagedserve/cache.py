"""The user cache the engine writes into, and the one lock every writer of it takes.

Two things are built once and kept there: the embedded model's Hugging Face folder
(server/loader/default_model.py) and, in a source checkout without prebuilt kernels, the CPU kernels
(kernels/cpu_build.py). Both are built in a temporary sibling and renamed into place while holding
``exclusive``: an ``flock``, which the kernel drops when its holder dies, so a start killed halfway
leaves no lock behind (only its temporary folder, which the next holder removes and says so). A start
that waits for a live builder says whom it waits for every few seconds, and gives up after ``timeout``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)
# How often a start that waits for another process's build says so.
WAIT_LOG_SECONDS = 10.0


def cache_root() -> Path:
    """``$PAGEDSERVE_CACHE``, else ``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve``."""
    explicit = os.environ.get("PAGEDSERVE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedserve"


@contextmanager
def exclusive(lock_path: Path, what: str, timeout: float = 900.0) -> Iterator[None]:
    """Hold ``lock_path``'s flock for the block; ``what`` names the work in the waiting messages.

    The holder's pid is written into the file so that a waiter can say whom it waits for. Raises
    ``TimeoutError`` after ``timeout`` seconds of waiting for a live holder."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        deadline = time.monotonic() + timeout
        next_log = time.monotonic() + 1.0  # a lock released within a second is not worth a line
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"waited {timeout:.0f} s for {_holder(lock_path)} to finish {what} "
                                       f"({lock_path})") from None
                if now >= next_log:
                    logger.warning("Waiting for %s to finish %s (%s)", _holder(lock_path), what, lock_path)
                    next_log = now + WAIT_LOG_SECONDS
                time.sleep(0.1)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield


def _holder(lock_path: Path) -> str:
    try:
        return f"process {int(lock_path.read_text().strip())}"
    except (OSError, ValueError):
        return "another process"
