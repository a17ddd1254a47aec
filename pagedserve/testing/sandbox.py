"""A pod's read-only root filesystem for a local process, with Linux mount namespaces (root, unshare).

``read_only_root(argv, writable)`` runs ``argv`` in a mount namespace of its own where the root filesystem
is read-only and only the ``writable`` folders take writes (besides the machine's separate mounts such as
/dev/shm, which a pod has as volumes too), as in a container with ``readOnlyRootFilesystem: true`` and
its volumes: a write anywhere else fails with EROFS. ``available()`` says whether this machine can.
The namespace ends with the process; nothing outside it changes.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path


def read_only_root(argv: Sequence[str], writable: Sequence[Path]) -> list[str]:
    """``argv`` wrapped: each writable folder is bind-mounted onto itself (a mount of its own keeps its
    own read-write flag), then the root mount is remounted read-only and the command replaces the shell."""
    binds = [f"mount --bind {shlex.quote(str(f))} {shlex.quote(str(f))}" for f in map(Path, writable)]
    script = " && ".join([*binds, "mount -o remount,bind,ro /", 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


@functools.cache
def available() -> bool:
    """Root, unshare, and a mount namespace in which / can be remounted read-only (not in every container)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(read_only_root(["true"], []), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0
