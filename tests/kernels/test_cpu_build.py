"""Building the CPU kernels where no prebuilt library fits (kernels/cpu_build.py), and the cache lock
every build and conversion takes (pagedserve/cache.py): a build killed midway costs the next start a
rebuild, never a hang, and a start that waits says for whom."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pagedserve.kernels import cpu_build

from pagedserve import cache

# A start in a source checkout without the prebuilt libraries: the generic level, the quickest to build.
START = """
from pathlib import Path
from pagedserve.kernels import cpu, cpu_build
cpu_build.PREBUILT = Path("/nonexistent")  # as in a checkout where `make setup` never built them
library = cpu.loaded_library()
print("LOADED", library.level, library.origin, cpu.load_extension().rms_norm)
"""


def start(cache_dir: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PAGEDSERVE_CACHE": str(cache_dir), "PAGEDSERVE_CPU_ISA": "generic",
           "PYTHONSAFEPATH": "1"}
    return subprocess.Popen([sys.executable, "-c", START], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.heavy  # ~35 s: a real build, killed, then a real start
def test_a_start_killed_while_building_leaves_nothing_that_stops_the_next(tmp_path: Path) -> None:
    first = start(tmp_path)
    builds = tmp_path / "cpu-kernels"
    deadline = time.monotonic() + 60
    while not list(builds.glob(".*.tmp-*")):  # compiling: its temporary folder is there
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    time.sleep(1.0)
    first.send_signal(signal.SIGKILL)
    first.wait()

    began = time.monotonic()
    second = start(tmp_path)
    out, err = second.communicate(timeout=120)
    took = time.monotonic() - began
    assert second.returncode == 0, err[-3000:]
    assert "LOADED generic cache" in out
    assert "left by a kernel build that did not finish" in err, err[-3000:]
    assert took < 60, f"the second start took {took:.0f} s"
    assert not list(builds.glob(".*.tmp-*"))


def test_a_waiting_start_says_whom_it_waits_for(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(cache, "WAIT_LOG_SECONDS", 0.2)
    lock = tmp_path / "thing.lock"
    entered, release = threading.Event(), threading.Event()

    def holder() -> None:
        with cache.exclusive(lock, "holding"):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    entered.wait(10)
    try:
        waited = pytest.raises(TimeoutError, match=f"process {os.getpid()}")
        with caplog.at_level(logging.WARNING), waited, cache.exclusive(lock, "building the thing", 1.5):
            pass
    finally:
        release.set()
        thread.join()
    waits = [r.getMessage() for r in caplog.records if "Waiting for" in r.getMessage()]
    assert waits and f"process {os.getpid()} to finish building the thing" in waits[0]
    with cache.exclusive(lock, "after"):  # released with its holder
        pass


def test_each_install_builds_into_its_own_folder(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    here = cpu_build.jit_folder("k")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert cpu_build.jit_folder("k") != here and here.parent == cpu_build.jit_folder("k").parent
