"""Real processes for tests and benchmarks: `pagedserve serve`, `pagedserve router`, the fake OpenAI
backend (pagedserve/testing/fake_openai.py) or any other command.

Each runs in its own session with its output in a log file, and is always stopped: SIGTERM to its
process group, SIGKILL after ``stop_timeout_s``. Use it as a context manager (or call ``start()`` and
``stop()`` from a fixture)::

    with serve_process(tmp_path / "engine.log", "--max-model-len", "512") as engine:
        engine.wait_ready(240)
        httpx.get(engine.url + "/v1/models")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pagedserve.testing.net import free_port, log_tail, wait_http

# Set in every child unless the caller's env says otherwise.
CHILD_ENV_DEFAULTS = {
    # Spinning OpenMP threads slow torch several-fold when processes share cores (a test server beside
    # pytest); pagedserve/cli.py sets the same default, `python -m pagedserve.router` does not go there.
    "OMP_WAIT_POLICY": "PASSIVE",
    # `python -m` puts the working directory first on sys.path, where ./operator would shadow the
    # standard library's `operator` module (see Makefile).
    "PYTHONSAFEPATH": "1",
}

# The question the README, `make serve` and the server and e2e tests ask the embedded model, and the word
# its answer holds, in every mode. Not France: in gguf mode (the embedded model's default on a CPU) that
# question's first token is a near-tie ("The" -1.88 against "L" -1.97 nats in float32) which the blocks'
# rounding flips into "L'Étoile, ...", as llama.cpp does on the same file; here "The" leads "Der" by
# 0.66 nats in float32 and 0.58 in gguf (benchmarks/README.md, "The embedded model's default mode").
DEMO_QUESTION = "What is the capital of Germany?"
DEMO_ANSWER = "Berlin"

P = TypeVar("P", bound="ManagedProcess")


@dataclass(kw_only=True)
class ManagedProcess:
    """One command as a child process; ``start()`` again after it ended starts it anew (same log)."""

    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None  # the child's whole environment; None: this process's
    cwd: Path | None = None
    cpus: set[int] | None = None  # pin the child (and its threads) to these cores
    lifetime_s: float | None = None  # wrap in `timeout`: it dies after this long whatever the caller does
    stop_timeout_s: float = 15.0
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self: P) -> P:
        if self.running:
            raise RuntimeError(f"already running: {self.argv[0]} (pid {self.pid})")
        argv = list(self.argv)
        if self.lifetime_s is not None:
            argv = ["timeout", "-k", "5", str(self.lifetime_s), *argv]
        env = dict(os.environ if self.env is None else self.env)
        for key, value in CHILD_ENV_DEFAULTS.items():
            env.setdefault(key, value)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,  # one process group: stop() reaches its children too
                preexec_fn=self._pin if self.cpus else None,
            )
        return self

    def _pin(self) -> None:
        os.sched_setaffinity(0, self.cpus or set())

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("not started")
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        """Raise RuntimeError, with the log's tail, if the process has ended."""
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"{self.log_path.stem}: exited with {self.process.returncode}:\n{self.log_tail()}"
            )

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process group at once (a replica that dies)."""
        if self.process is not None:
            self._signal_group(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; returns the exit code (None: never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        self._signal_group(signal.SIGKILL)  # whatever of its group outlived it
        return self.process.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log_path, chars)

    def __enter__(self: P) -> P:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(kw_only=True)
class ServerProcess(ManagedProcess):
    """A process that serves HTTP on ``host:port`` and says it is ready on ``ready_path``."""

    port: int
    host: str = "127.0.0.1"
    ready_path: str = "/health"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait for ``ready_path`` to answer 200; fails at once, with the log's tail, if the process dies."""
        wait_http(self.url + self.ready_path, self.process, timeout, self.log_path)


def spawn_children(pid: int) -> list[int]:
    """The multiprocessing "spawn" children of ``pid`` (not its resource tracker), oldest first."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def engine_core_pid(server_pid: int) -> int:
    """The process of a `pagedserve serve`'s engine core (server/engine/core_proc.py): its one spawn child."""
    (core,) = spawn_children(server_pid)
    return core


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds (all threads) that process ``pid`` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def container_program(name: str) -> str:
    """A container command's program from this environment (the image has it on PATH): the one beside
    this interpreter, else PATH's, else the name as it is."""
    local = Path(sys.executable).with_name(name)
    return str(local) if local.exists() else shutil.which(name) or name


def pagedserve_argv(*args: str) -> list[str]:
    """`pagedserve ARGS` run by this interpreter (its console script need not be on PATH)."""
    return [sys.executable, "-m", "pagedserve.cli", *args]


def serve_process(
    log_path: Path, *args: str, port: int | None = None, host: str = "127.0.0.1", **kw
) -> ServerProcess:
    """`pagedserve serve` (the embedded model in its default mode, gguf on a CPU, unless ``args`` name
    another model or mode; ``float_model_args()`` for its float32 weights) on ``host:port``."""
    port = port or free_port(host)
    argv = pagedserve_argv("serve", "--host", host, "--port", str(port), *args)
    return ServerProcess(argv=argv, log_path=log_path, port=port, host=host, **kw)


def float_model_args() -> tuple[str, ...]:
    """`serve` flags for the embedded model's float32 weights, which tests comparing with HF Transformers
    (or HF + peft, or an ``LLM`` of the folder) serve: its converted folder named by path is its float
    tensors, where the model left unnamed runs its GGUF blocks (server/config.py
    ``checkpoint_quantization``). Served under the folder's name, as the model left unnamed is."""
    from pagedserve import default_model

    folder = str(default_model())
    return ("--model", folder, "--served-model-name", os.path.basename(folder))


def router_process(
    log_path: Path,
    backends: Sequence[str],
    *args: str,
    port: int | None = None,
    host: str = "127.0.0.1",
    ready_path: str = "/ready",
    **kw,
) -> ServerProcess:
    """`pagedserve router` in front of ``backends`` (none: ``args`` give the discovery); ready once it
    has a ready backend (``/ready``)."""
    port = port or free_port(host)
    backend_args = [arg for url in backends for arg in ("--backend", url)]
    argv = pagedserve_argv("router", "--host", host, "--port", str(port), *backend_args, *args)
    return ServerProcess(argv=argv, log_path=log_path, port=port, host=host, ready_path=ready_path, **kw)


def fake_openai_process(
    log_path: Path, *args: str, port: int | None = None, host: str = "127.0.0.1", **kw
) -> ServerProcess:
    """The fake OpenAI backend (pagedserve/testing/fake_openai.py; ``args``: its command-line flags)."""
    port = port or free_port(host)
    argv = [sys.executable, "-m", "pagedserve.testing.fake_openai", "--host", host, "--port", str(port)]
    argv += args
    return ServerProcess(argv=argv, log_path=log_path, port=port, host=host, **kw)
