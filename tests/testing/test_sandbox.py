"""pagedserve/testing/sandbox.py: a read-only root with writable folders, as a pod's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pagedserve.testing import sandbox

pytestmark = pytest.mark.skipif(not sandbox.available(), reason="needs root and mount namespaces")


def test_only_the_writable_folders_take_writes(tmp_path: Path) -> None:
    writable, other = tmp_path / "volume", tmp_path / "elsewhere"
    writable.mkdir(), other.mkdir()
    script = f"touch {writable}/ok && touch {other}/no"
    done = subprocess.run(sandbox.read_only_root(["sh", "-c", script], [writable]), capture_output=True)
    assert done.returncode != 0 and b"Read-only file system" in done.stderr, done
    assert (writable / "ok").exists() and not (other / "no").exists()
    # outside the namespace nothing changed
    (other / "yes").touch()
