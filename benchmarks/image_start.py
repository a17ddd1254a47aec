"""An engine pod's start, measured: the CPU image with the embedded model, from `podman run` to ready.

The engine container of the CPU ModelDeployment the operator renders (pagedserve/testing/pods.py) runs
under podman as its pod runs (pagedserve/testing/images.py: its user, read-only root filesystem, fresh
emptyDir volumes, as a new pod or a scale-from-zero wake-up gets them), on this machine's loopback.
Per run: seconds from `podman run` to the first 200 from /health (the readiness probe's path), and to the
first answer of the demo question; and the start's log lines that say what it built, converted or loaded.

    PYTHONSAFEPATH=1 python -m pagedserve.benchmarks.image_start [--image TAG] [--repeats 3] [--cpu-isa avx2]

Needs podman and the image (`make images`); run as root, as `make image-test` does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

# Log lines worth showing: what the start did before it could serve.
NOTABLE = ("CPU kernels", "Building", "Converting", "Removing", "Waiting for", "KV cache", "Uvicorn running")


def one_start(image: str | None, cpu_isa: str | None = None) -> dict[str, float | list[str]]:
    from pagedserve.testing import pods
    from pagedserve.testing.images import NAME_PREFIX, PODMAN, podman_run
    from pagedserve.testing.net import free_port
    from pagedserve.testing.processes import DEMO_QUESTION

    engine = pods.containers()["engine"]
    if image:
        engine = {**engine, "container": {**engine["container"], "image": image}}
    if cpu_isa:  # the pod as a lesser CPU runs it (kernels/cpu_features.py)
        from pagedserve.kernels.cpu_features import emulation_env

        capped = [{"name": name, "value": value} for name, value in emulation_env(cpu_isa).items()]
        env = [*engine["container"]["env"], *capped]
        engine = {**engine, "container": {**engine["container"], "env": env}}
    port = free_port()
    router = pods.containers()["router"]["container"]
    args, _ = pods.loopback_args(engine["container"], router, port, port + 1)
    with tempfile.TemporaryDirectory() as workdir:
        argv = podman_run(engine, [*engine["container"]["command"], *args], Path(workdir))
        log_path = Path(workdir) / "engine.log"
        with open(log_path, "w") as log:
            began = time.monotonic()
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            try:
                ready = _wait(f"http://127.0.0.1:{port}/health", process, began)
                body = {"model": pods.NAME, "messages": [{"role": "user", "content": DEMO_QUESTION}],
                        "temperature": 0, "max_tokens": 16}
                headers = {"Authorization": f"Bearer {pods.API_KEY}"}
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers,
                                   timeout=120)
                answered = time.monotonic() - began
                reply.raise_for_status()
            finally:
                process.terminate()
                process.wait(60)
                name = f"{NAME_PREFIX}-engine-{os.getpid()}"
                subprocess.run([*PODMAN, "rm", "--force", "--ignore", name], capture_output=True, timeout=120)
        lines = [line.strip() for line in log_path.read_text().splitlines()
                 if any(notable in line for notable in NOTABLE) and "%|" not in line]  # not progress bars
    return {"ready_s": ready, "answered_s": answered, "log": lines}


def _wait(url: str, process: subprocess.Popen, began: float, timeout: float = 600) -> float:
    while time.monotonic() - began < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the container exited with {process.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image", default=None, help="the engine image (default: the operator's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-isa", default=None, help="run the container as a CPU of this level: avx2")
    args = parser.parse_args(argv)
    for run in range(1, args.repeats + 1):
        figures = one_start(args.image, args.cpu_isa)
        print(f"run {run}: ready {figures['ready_s']:.1f} s, first answer {figures['answered_s']:.1f} s "
              f"after `podman run`; load average {os.getloadavg()[0]:.1f}", flush=True)
        for line in figures["log"]:
            print(f"    {line}")


if __name__ == "__main__":
    main()
