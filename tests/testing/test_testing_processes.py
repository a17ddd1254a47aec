"""pagedserve.testing's process helpers: fail fast with the log, always clean up, light imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagedserve.testing.net import free_port, wait_http
from pagedserve.testing.processes import ManagedProcess, ServerProcess


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (its parent was killed)."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_wait_ready_fails_fast_with_the_log_tail(tmp_path):
    server = ServerProcess(
        argv=python("print('no model here', flush=True); raise SystemExit(3)"),
        log_path=tmp_path / "dies.log",
        port=free_port(),
    )
    started = time.monotonic()
    with server, pytest.raises(RuntimeError, match="exited with 3") as err:
        server.wait_ready(timeout=60)
    assert "no model here" in str(err.value)
    assert time.monotonic() - started < 30  # not the whole timeout


def test_wait_http_times_out_with_the_log_tail(tmp_path):
    log = tmp_path / "quiet.log"
    log.write_text("still loading\n")
    with pytest.raises(TimeoutError, match="still loading"):
        wait_http(f"http://127.0.0.1:{free_port()}/health", timeout=0.5, log=log)


def test_stop_kills_what_ignores_sigterm_and_its_children(tmp_path):
    code = """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    """
    proc = ManagedProcess(argv=python(code), log_path=tmp_path / "stubborn.log", stop_timeout_s=0.5)
    with proc:
        deadline = time.monotonic() + 30
        while not proc.log_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(proc.log_text().split()[0])
        assert not gone(child)
    assert proc.process is not None and proc.process.returncode == -9  # SIGKILL after the grace time
    deadline = time.monotonic() + 5
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child)


def test_child_env_defaults_and_the_callers_env(tmp_path):
    code = "import os; print(*(os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'PYTHONSAFEPATH', 'X')))"
    with ManagedProcess(argv=python(code), log_path=tmp_path / "a.log", env={"X": "1"}) as proc:
        proc.process.wait(30)
    assert proc.log_text().split() == ["PASSIVE", "1", "1"]
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    with ManagedProcess(argv=python(code), log_path=tmp_path / "b.log", env=env) as proc:
        proc.process.wait(30)
    assert proc.log_text().split() == ["ACTIVE", "1", "None"]


def test_check_alive_and_restart_append_to_the_log(tmp_path):
    proc = ManagedProcess(argv=python("print('run')"), log_path=tmp_path / "twice.log")
    for _ in range(2):
        with proc:
            proc.process.wait(30)
            with pytest.raises(RuntimeError, match="exited with 0"):
                proc.check_alive()
    assert proc.log_text().split() == ["run", "run"]


def test_the_package_imports_without_torch():
    code = (
        "import sys, pagedserve.testing.net, pagedserve.testing.processes, pagedserve.testing.fake_openai, "
        "pagedserve.testing.server_thread, pagedserve.testing.tiny_tokenizer; "
        "heavy = [m for m in ('torch', 'transformers', 'uvicorn') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
