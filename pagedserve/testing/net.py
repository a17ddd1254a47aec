"""Ports and readiness checks for servers that tests and benchmarks start on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx

LOG_TAIL_CHARS = 4000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's pick; another process may take it later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(log: Path | None, chars: int = LOG_TAIL_CHARS) -> str:
    if log is None or not log.exists():
        return ""
    return log.read_text(errors="replace")[-chars:]


def wait_http(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout: float = 60.0,
    log: Path | None = None,
    interval: float = 0.2,
) -> None:
    """Poll ``url`` until it answers 200.

    Raises RuntimeError as soon as ``proc`` exits (no point waiting out the timeout for a dead server)
    and TimeoutError after ``timeout`` seconds; both messages end with the tail of ``log``.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout} s:\n{log_tail(log)}")
        time.sleep(interval)


def wait_until(cond, timeout: float, what: str, interval: float = 0.25) -> None:
    """Poll ``cond()`` until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for: {what}")
