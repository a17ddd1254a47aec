"""(b) engine decode step time at batch 1 against the roofline, and (d) the share of wall time the GPU
is busy during steady decode at batch 64, both through the engine API on one loaded model.

(b): one request (128 prompt tokens, greedy, ``ignore_eos``); each ``engine.step()`` after the prefill
is timed on the host clock, back to back as a serving loop runs them (no synchronization between steps,
so async scheduling overlaps as it does in service): scheduling, input preparation, the forward pass,
sampling and detokenization included. Roofline: the bytes a decode step must read (every weight but the
embedding table, of which it reads one row per token, plus the KV cache so far) over the measured
device-to-device copy bandwidth.

(d): 64 requests decode together; after warm-up steps, ``STEPS`` steps run under ``torch.profiler``
(CUDA activity only). Busy time is the union of the intervals of the GPU's kernels, copies and memsets;
the share is busy time over the wall time of those steps. The same steps' mean time without the
profiler is reported beside it, to show what the profiler itself costs, with the host time per engine
phase, the device's idle time per step (gaps of 20 µs or more, and shorter ones) and the kernels that
take the most of it. ``--profile-batch-1`` profiles batch-1 steps the same way;
``--no-async-scheduling`` runs the engine without async scheduling (results named ``_sync``).

    python -m pagedserve.benchmarks.gpu.random_model --shape llama3-8b --out /tmp/llama3-8b
    python -m pagedserve.benchmarks.gpu.engine_decode --model /tmp/llama3-8b [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from pagedserve.benchmarks.gpu.common import copy_bandwidth, device_info, write_result
from pagedserve.server.worker import model_runner

from pagedserve import LLM, SamplingParams


def decode_bytes(llm: LLM) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV bytes per token of context across all layers)."""
    model = llm.engine.core.executor.model
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = next(p for n, p in params.items() if "embed_tokens" in n)
    if any(n.startswith("lm_head") for n in params):  # untied: the table itself is only gathered from
        total -= embed.numel() * embed.element_size()
    layers = model.attention_layers()
    k_cache = layers[0].k_cache
    per_token = 2 * len(layers) * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return total, per_token


def prompt(vocab: int, n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(10, vocab - 10, (n,), generator=gen).tolist()}


def add_requests(llm: LLM, count: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(count):
        engine.add(engine.process_inputs(f"{tag}-{i}", prompt(engine.vocab_size, prompt_len, i), params))


def timed_steps(llm: LLM, steps: int) -> list[float]:
    """Each step's wall time, back to back as a serving loop runs them: no synchronization between steps,
    which would stop async scheduling from overlapping one step's host work with the next one's device
    work (the device's queue is drained before the first step and counted in the last)."""
    torch.cuda.synchronize()
    times = []
    last = time.perf_counter()
    for i in range(steps):
        llm.engine.step()
        if i == steps - 1:
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def batch1(llm: LLM, copy_bw: float, new_tokens: int) -> dict:
    add_requests(llm, 1, 128, new_tokens, "b1")
    llm.engine.step()  # the prefill
    times = timed_steps(llm, new_tokens - 1)  # every decode step
    while llm.engine.has_unfinished():
        llm.engine.step()
    weights, kv_per_token = decode_bytes(llm)
    mean_context = 128 + new_tokens / 2
    step_bytes = weights + kv_per_token * mean_context
    roofline = step_bytes / copy_bw
    median = statistics.median(times)
    return {
        "decode_steps": len(times),
        "step_seconds_median": median,
        "step_seconds_mean": statistics.fmean(times),
        "step_seconds_p90": sorted(times)[int(0.9 * len(times))],
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step_mean": kv_per_token * mean_context,
        "roofline_seconds": roofline,
        "median_step_over_roofline": median / roofline,
        "roofline_over_median_step": roofline / median,
    }


def profiled_steps(llm: LLM, steps: int) -> tuple[float, list[dict]]:
    """Wall seconds of ``steps`` engine steps under ``torch.profiler`` (CUDA activity only), and the
    device's kernel, copy and memset intervals in them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in kinds]
    return wall, device


def device_figures(wall: float, events: list[dict], steps: int, top: int = 12) -> dict:
    """Busy share (the union of the device's intervals over the wall time), the largest gap per step, and
    the kernels that take the most device time per step (what a step's GPU time is made of)."""
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, end, gaps = 0.0, float("-inf"), []
    for lo, hi in intervals:  # union of device intervals, in microseconds
        if end > float("-inf") and lo > end:
            gaps.append(lo - end)
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    per_kernel: dict[str, list[float]] = {}
    for e in events:
        per_kernel.setdefault(e["name"][:90], []).append(e["dur"])
    kernels = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    gaps.sort(reverse=True)
    return {
        "gpu_busy_share": busy / 1e6 / wall,
        "gpu_busy_seconds": busy / 1e6,
        "wall_seconds": wall,
        "step_seconds_profiled_mean": wall / steps,
        "device_events": len(intervals),
        "device_events_per_step": len(intervals) / steps,
        # idle device time per step in gaps of 20 us or more (host work, syncs) and below (launch gaps)
        "idle_us_per_step_long_gaps": sum(g for g in gaps if g >= 20) / steps,
        "idle_us_per_step_short_gaps": sum(g for g in gaps if g < 20) / steps,
        "top_kernels": [{"name": name, "us_per_step": sum(d) / steps, "calls_per_step": len(d) / steps}
                        for name, d in kernels],
    }


class PhaseTimer:
    """Host seconds spent in named engine methods (wrapped on their instances while it is entered)."""

    def __init__(self, targets: dict[str, tuple[object, str]]) -> None:
        self.targets = targets
        self.seconds = dict.fromkeys(targets, 0.0)
        self.saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> PhaseTimer:
        for phase, (owner, name) in self.targets.items():
            inner = getattr(owner, name)
            self.saved.append((owner, name, vars(owner).get(name)))

            def timed(*args, _inner=inner, _phase=phase, **kwargs):
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    self.seconds[_phase] += time.perf_counter() - start

            setattr(owner, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, own in self.saved:  # a module's function back; an instance's to its class's
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def host_phases(llm: LLM) -> PhaseTimer:
    core = llm.engine.core
    runner = core.executor.runner
    return PhaseTimer({
        "schedule": (core.scheduler, "schedule"),
        "prepare_inputs": (runner, "prepare"),
        "forward_launch": (runner, "run_model"),
        "logits": (runner, "compute_logits"),
        "sample_launch": (model_runner, "launch_sample"),
        "read_back": (model_runner.LaunchedStep, "result"),  # waits for the step's tokens
        "update_from_output": (core.scheduler, "update_from_output"),
        "process_outputs": (llm.engine.output_processor, "process_outputs"),
    })


def busy_share(llm: LLM, batch: int, warmup: int, steps: int) -> dict:
    add_requests(llm, batch, 128, warmup + 3 * steps + 8, "d")  # warm-up, plain, phases, profiled
    while any(r.num_computed_tokens < len(r.prompt_token_ids)
              for r in llm.engine.core.scheduler.running + list(llm.engine.core.scheduler.waiting)):
        llm.engine.step()  # prefills
    timed_steps(llm, warmup)
    plain = timed_steps(llm, steps)
    with host_phases(llm) as phases:
        timed_steps(llm, steps)
    wall, events = profiled_steps(llm, steps)
    figures = device_figures(wall, events, steps)
    while llm.engine.has_unfinished():
        llm.engine.step()
    return {"batch": batch, "profiled_steps": steps, "step_seconds_unprofiled_mean": statistics.fmean(plain),
            # host ms per step in each phase
            "host_ms_per_step": {k: 1e3 * v / steps for k, v in phases.seconds.items()},
            **figures}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a folder from pagedserve.benchmarks.gpu.random_model")
    parser.add_argument("--new-tokens", type=int, default=128, help="(b): decode steps timed at batch 1")
    parser.add_argument("--batch", type=int, default=64, help="(d): requests decoding together")
    parser.add_argument("--steps", type=int, default=30, help="(d): profiled steps")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="default: the engine's (on a GPU); --no-async-scheduling: results named _sync")
    parser.add_argument("--quantization", default=None, help="e.g. int8 (the Triton w8a16 kernel)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    parser.add_argument("--skip-busy-share", action="store_true", help="(b) only")
    parser.add_argument("--profile-batch-1", action="store_true",
                        help="also profile batch-1 steps: busy share, idle gaps, top kernels")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    copy_bw = copy_bandwidth()
    t = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", kv_cache_memory_bytes=8 << 30, max_model_len=4096,
              enforce_eager=args.enforce_eager, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, async_scheduling=args.async_scheduling)
    load_seconds = time.perf_counter() - t
    # Warm-up: compiles the Triton kernels (and captures graphs, where the engine does so).
    llm.generate([prompt(llm.engine.vocab_size, 64, 99)] * 2,
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    common = {"device": device_info(), "model": args.model, "dtype": "bfloat16",
              "enforce_eager": args.enforce_eager, "quantization": args.quantization,
              "async_scheduling": llm.engine.core.async_scheduling,
              "kv_cache_dtype": args.kv_cache_dtype, "copy_bandwidth_gbps": copy_bw / 1e9,
              "load_seconds": load_seconds}
    # Results of a quantized or FP8-cache run are named apart from the plain run's.
    mode = (f"_{args.quantization}" if args.quantization else "") + (
        "" if args.kv_cache_dtype == "auto" else f"_kv-{args.kv_cache_dtype}") + (
        "_sync" if args.async_scheduling is False else "")
    write_result(f"b_decode_step_roofline{mode}", {"benchmark": "engine decode step at batch 1 vs roofline",
                                            **common, **batch1(llm, copy_bw, args.new_tokens)}, args.out)
    if args.skip_busy_share:
        return
    write_result(f"d_gpu_busy_share{mode}", {"benchmark": "GPU busy share during steady decode",
                                      **common, **busy_share(llm, args.batch, 5, args.steps)}, args.out)
    if args.profile_batch_1:  # what a batch-1 step's device time is made of, and how much of it idles
        write_result(f"b_device_profile{mode}", {"benchmark": "batch-1 decode steps under the profiler",
                                                 **common, **busy_share(llm, 1, 5, args.steps)}, args.out)


if __name__ == "__main__":
    main()
