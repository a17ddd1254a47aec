"""The engine's own host time per sequence-step, with a model whose forward pass is nearly free.

A 2-layer, hidden-64 Llama of random weights (pagedserve/testing/tiny_models.py) makes the forward pass
cost little next to the engine's Python: scheduling, input preparation, sampling, stops, outputs. The
benchmark runs ``--batch`` prompts at once through ``LLM.generate`` (every request generating exactly
``--output-len`` tokens, greedy, ignore_eos) and reports, for the steady decode steps (every request
running, none prefilling):

- wall µs per sequence-step: a decode step's wall time / the batch;
- host µs per sequence-step: the same less the model's forward pass and logits (timed around
  ``ModelRunner.run_model`` and ``compute_logits``), i.e. what the engine itself spends.

``--profile`` adds a table of where the host time goes (cProfile over the decode steps, own time per
function, the top rows).

``--server`` also serves the same model with `pagedserve serve` and sends ``--batch`` concurrent streaming
/v1/completions requests of the same shape (benchmarks/http_overhead.py's client): output tok/s through
the whole server. ``--baseline DIR`` runs that server a second time from another install of pagedserve
(``pip install --no-deps --target DIR <a checkout of the old code>``; it goes first on PYTHONPATH), the
two alternating, so old and new are measured in one run on the same machine.

    python -m pagedserve.benchmarks.host_overhead --batch 64 256
    python -m pagedserve.benchmarks.host_overhead --batch 256 --profile
    python -m pagedserve.benchmarks.host_overhead --batch 256 --server --baseline /tmp/old-pagedserve
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Generation:
    decode_steps: list[tuple[float, float]]  # (wall s, forward s) of each all-decoding step
    wall_s: float  # the whole generate call, prefill included
    forward_s: float


@dataclass
class StepFigures:
    batch: int
    decode_steps: int
    wall_us_per_seq_step: float  # median decode step wall time / batch
    host_us_per_seq_step: float  # the same, less the forward pass and the logits
    forward_us_per_seq_step: float
    # The whole LLM.generate call (prefill steps and the tail included) per generated token
    generate_host_us_per_token: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="concurrent sequences")
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="print where the host time goes")
    p.add_argument("--top", type=int, default=25, help="rows of the profile table")
    p.add_argument("--server", action="store_true", help="also measure through `pagedserve serve`")
    p.add_argument("--baseline", default=None, help="an install of the old code to serve side by side")
    p.add_argument("--repeats", type=int, default=3, help="server runs per side")
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def tiny_model(folder: Path) -> Path:
    """A 2-layer, hidden-64 Llama with the tiny byte tokenizer: its forward costs microseconds."""
    from transformers import LlamaConfig

    from pagedserve.testing.tiny_models import TINY, tiny_checkpoint

    config = LlamaConfig(**{**TINY, "max_position_embeddings": 1024}, num_attention_heads=4,
                         num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    tiny_checkpoint(config, folder)
    return folder


class StepTimer:
    """Times every engine step, and inside it the model's forward pass and logits."""

    def __init__(self, runner: Any) -> None:
        self.forward_s = 0.0
        self._wrap(runner, "run_model")
        self._wrap(runner, "compute_logits")

    def _wrap(self, runner: Any, name: str) -> None:
        inner: Callable[..., Any] = getattr(runner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.forward_s += time.perf_counter() - start

        setattr(runner, name, timed)


def timed_generate(llm: Any, prompts: list[list[int]], output_len: int,
                   profiler: cProfile.Profile | None) -> Generation:
    """``LLM.generate`` over the prompts, each step timed: the steps in which every request decodes (from
    the first after the prompts are all in to the one before the first request finishes) are kept apart,
    and profiled when asked."""
    from pagedserve import SamplingParams

    engine = llm.engine
    timer = StepTimer(engine.core.executor.runner)
    inner_step = engine.step
    decode: list[tuple[float, float]] = []

    def step() -> Any:
        decoding = _all_decoding(engine, len(prompts))
        forward = timer.forward_s
        if decoding and profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        try:
            return inner_step()
        finally:
            wall = time.perf_counter() - start
            if decoding and profiler is not None:
                profiler.disable()
            if decoding:
                decode.append((wall, timer.forward_s - forward))

    engine.step = step
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    try:
        llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    finally:
        del engine.step
    return Generation(decode, time.perf_counter() - start, timer.forward_s)


def _all_decoding(engine: Any, batch: int) -> bool:
    running = engine.core.scheduler.running
    return len(running) == batch and all(r.num_computed_tokens == r.num_tokens - 1 for r in running)


def measure(llm: Any, batch: int, args: argparse.Namespace, profiler: cProfile.Profile | None) -> StepFigures:
    import random

    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 259) for _ in range(args.input_len)] for _ in range(batch)]
    timed_generate(llm, prompts[:4], 4, None)  # warm-up
    run = timed_generate(llm, prompts, args.output_len, profiler)
    wall = statistics.median(w for w, _ in run.decode_steps)
    forward = statistics.median(f for _, f in run.decode_steps)
    generated = batch * args.output_len
    return StepFigures(batch, len(run.decode_steps), 1e6 * wall / batch, 1e6 * (wall - forward) / batch,
                       1e6 * forward / batch, 1e6 * (run.wall_s - run.forward_s) / generated)


@contextmanager
def engine_for(batch: int, model: Path, args: argparse.Namespace) -> Iterator[Any]:
    from pagedserve import LLM

    llm = LLM(str(model), device="cpu", dtype="float32", max_num_seqs=batch,
              max_num_batched_tokens=max(2048, batch * args.input_len), max_model_len=1024,
              enable_prefix_caching=False)
    try:
        yield llm
    finally:
        llm.shutdown()


def profile_table(profiler: cProfile.Profile, top: int) -> str:
    stats = pstats.Stats(profiler)
    total = sum(row[2] for row in stats.stats.values())  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # type: ignore[attr-defined]
    lines = ["| own time | share | calls | function |", "| --- | --- | --- | --- |"]
    for (path, line, name), (_, calls, own, _, _) in rows:
        where = f"{_short(path)}:{line} {name}" if line else name
        lines.append(f"| {1e3 * own:.1f} ms | {100 * own / total:.1f}% | {calls} | `{where}` |")
    return "\n".join(lines)


def _short(path: str) -> str:
    for marker in ("pagedserve/", "site-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def serve(model: Path, batch: int, pythonpath: str | None) -> Any:
    """`pagedserve serve` of the tiny model, as the offline side runs it; ``pythonpath``: another install."""
    import os

    from pagedserve.testing.processes import serve_process

    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_API_KEY"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    flags = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--max-num-seqs", str(batch),
             "--max-model-len", "1024", "--no-enable-prefix-caching", "--disable-log-requests"]
    log = Path(tempfile.mkstemp(prefix="host-overhead-serve-", suffix=".log")[1])
    server = serve_process(log, *flags, env=env, stop_timeout_s=60).start()
    try:
        server.wait_ready(600.0)
    except BaseException:
        server.stop()
        raise
    return server


def server_tok_s(model: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Output tok/s through the server at each batch, per side ("new": this install; "baseline")."""
    import asyncio
    import random

    from pagedserve.benchmarks.http_overhead import run_http

    sides = {"new": None, **({"baseline": args.baseline} if args.baseline else {})}
    results: dict[str, list[float]] = {f"{side}@{batch}": [] for side in sides for batch in args.batch}
    for batch in args.batch:
        servers = {side: serve(model, batch, path) for side, path in sides.items()}
        try:
            rng = random.Random(batch)
            for repeat in range(args.repeats):
                prompts = [[rng.randrange(3, 259) for _ in range(args.input_len)] for _ in range(batch)]
                for side, server in servers.items():
                    if repeat == 0:  # warm-up
                        asyncio.run(run_http(server.url, prompts[:4], 4, server.pid))
                    run = asyncio.run(run_http(server.url, prompts, args.output_len, server.pid))
                    results[f"{side}@{batch}"].append(run.tok_s)
                    print(f"server {side}, {batch} concurrent streams: {run.tok_s:.1f} output tok/s",
                          flush=True)
        finally:
            for server in servers.values():
                server.stop()
                server.log_path.unlink(missing_ok=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results: list[StepFigures] = []
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        model = tiny_model(Path(tmp))
        for batch in args.batch:
            profiler = cProfile.Profile() if args.profile else None
            with engine_for(batch, model, args) as llm:
                figures = measure(llm, batch, args, profiler)
            results.append(figures)
            print(f"batch {batch}: {figures.host_us_per_seq_step:.1f} host µs per sequence-step "
                  f"(wall {figures.wall_us_per_seq_step:.1f}, forward {figures.forward_us_per_seq_step:.1f}; "
                  f"median of {figures.decode_steps} decode steps); the whole generate call: "
                  f"{figures.generate_host_us_per_token:.1f} host µs per generated token", flush=True)
            if profiler is not None:
                print(profile_table(profiler, args.top), flush=True)
        served = server_tok_s(model, args) if args.server else {}
    for key, runs in served.items():
        print(f"server {key.replace('@', ', batch ')}: median {statistics.median(runs):.1f} output tok/s "
              f"of {len(runs)} runs", flush=True)
    for batch in args.batch if args.baseline and served else []:
        new, old = (statistics.median(served[f"{side}@{batch}"]) for side in ("new", "baseline"))
        print(f"server at batch {batch}: new / baseline = {new / old:.2f}x", flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"offline": [asdict(r) for r in results], "server": served},
                                                indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
