"""`pagedserve bench plot RESULTS.json... --out DIR`: PNG charts of `bench serve` results.

Each result file is one series: a single run (a JSON object) or a sweep (a list of runs, as written by
``bench serve --max-concurrency 1,4,16``). vLLM's ``bench serve`` result files have the same keys and
plot too. Two charts:

- ``throughput.png``: output tokens/s and requests/s against max concurrency (or request rate);
- ``latency.png``: TTFT, TPOT, ITL and end-to-end latency percentiles (median solid, then dashed and
  dotted for the higher ones) against the same axis.

When every file holds one run at the same x (say one run per setup), both charts are grouped bars
instead, one bar per file.

matplotlib (Agg backend) is imported only when plotting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

LATENCY_METRICS = (
    ("ttft", "Time to first token"),
    ("tpot", "Time per output token"),
    ("itl", "Inter-token latency"),
    ("e2el", "End-to-end latency"),
)
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "results", nargs="+", help="result files of `bench serve` (one run or a list of runs)"
    )
    parser.add_argument("--out", required=True, help="folder for the PNG files (created if missing)")
    parser.add_argument("--labels", default=None, help="comma list of series names, one per file")
    parser.add_argument(
        "--x",
        choices=("concurrency", "request-rate"),
        default="concurrency",
        help="x axis: max concurrency (unbounded = the number of prompts) or the configured request rate",
    )
    parser.add_argument("--percentiles", default="50,90,99", help="latency percentiles to draw")
    parser.add_argument("--title", default=None, help="title prefix for the charts")


def load_runs(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    runs = data if isinstance(data, list) else [data]
    if not runs or not all(isinstance(r, dict) for r in runs):
        raise ValueError(f"{path}: expected a result object or a list of them")
    return runs


def x_value(run: dict[str, Any], axis: str) -> float:
    if axis == "concurrency":
        c = run.get("max_concurrency")
        return (
            float(c) if c not in (None, "inf") else float(run.get("num_prompts") or run.get("completed") or 1)
        )
    r = run.get("request_rate")
    return math.inf if r in (None, "inf") or float(r) == math.inf else float(r)


def _metric(run: dict[str, Any], key: str, p: float) -> float | None:
    word = str(int(p)) if int(p) == p else str(p)
    v = run.get(f"p{word}_{key}_ms")
    if v is None and p == 50:
        v = run.get(f"median_{key}_ms")
    return None if v is None else float(v)


def _positions(series: list[list[dict]], axis: str) -> tuple[dict[float, float], list[float], list[str]]:
    """x positions: numbers as they are, except infinite rates, drawn one step right of the largest."""
    xs = sorted({x_value(r, axis) for runs in series for r in runs})
    finite = [x for x in xs if x != math.inf]
    inf_at = (max(finite) * 2 if finite else 1.0) if math.inf in xs else None
    pos = {x: (inf_at if x == math.inf else x) for x in xs}
    ticks = [pos[x] for x in xs]
    labels = ["inf" if x == math.inf else f"{x:g}" for x in xs]
    return pos, ticks, labels


def run(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        series = [load_runs(p) for p in args.results]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    labels = args.labels.split(",") if args.labels else []
    names = []
    for i, (path, runs) in enumerate(zip(args.results, series, strict=True)):
        if i < len(labels) and labels[i]:
            names.append(labels[i])
        elif runs[0].get("label"):
            names.append(str(runs[0]["label"]))
        else:
            names.append(os.path.splitext(os.path.basename(path))[0])
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    pos, ticks, tick_labels = _positions(series, args.x)
    xlabel = "max concurrency" if args.x == "concurrency" else "request rate (req/s)"
    log_x = len(ticks) > 1 and min(ticks) > 0 and max(ticks) / min(ticks) >= 8
    title = (args.title + ": ") if args.title else ""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    os.makedirs(args.out, exist_ok=True)

    def setup_x(ax: Any) -> None:
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels(tick_labels)
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)

    written = []
    # One point per series, all at the same x (e.g. one run per setup): grouped bars read better.
    bars = len(ticks) == 1

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = os.path.join(args.out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # --- throughput
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, ylabel, what in (
        (axes[0], "output_throughput", "output tokens/s", "output token throughput"),
        (axes[1], "request_throughput", "requests/s", "request throughput"),
    ):
        if bars:
            values = [float(runs[0].get(key, 0.0)) for runs in series]
            rects = ax.bar(
                range(len(names)), values, color=[colors[i % len(colors)] for i in range(len(names))]
            )
            ax.bar_label(rects, fmt="%.3g", fontsize=8)
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=15 if len(names) > 3 else 0)
            ax.set_xlabel(f"{xlabel} {tick_labels[0]}")
            ax.grid(True, axis="y", alpha=0.3)
        else:
            for i, (name, runs) in enumerate(zip(names, series, strict=True)):
                runs = sorted(runs, key=lambda r: x_value(r, args.x))
                xs = [pos[x_value(r, args.x)] for r in runs]
                ys = [float(r.get(key, 0.0)) for r in runs]
                ax.plot(xs, ys, "o-", color=colors[i % len(colors)], label=name)
            setup_x(ax)
            ax.legend(fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title + what)
        ax.set_ylim(bottom=0)
    save(fig, "throughput.png")

    # --- latency percentiles
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    words = ["median" if p == 50 else f"p{p:g}" for p in percentiles]
    for ax, (key, label) in zip(axes.flat, LATENCY_METRICS, strict=True):
        if bars:  # groups: percentiles; one bar per series
            width = 0.8 / max(len(names), 1)
            for i, (name, runs) in enumerate(zip(names, series, strict=True)):
                ys = [_metric(runs[0], key, p) for p in percentiles]
                xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(percentiles))]
                ax.bar(xs, [y or 0.0 for y in ys], width, color=colors[i % len(colors)], label=name)
            ax.set_xticks(range(len(percentiles)))
            ax.set_xticklabels(words)
            ax.set_xlabel(f"{xlabel} {tick_labels[0]}")
            ax.grid(True, axis="y", alpha=0.3)
        else:  # one colour per series, one line style and marker per percentile
            for i, (name, runs) in enumerate(zip(names, series, strict=True)):
                runs = sorted(runs, key=lambda r: x_value(r, args.x))
                for j, (p, word) in enumerate(zip(percentiles, words, strict=True)):
                    pts = [(pos[x_value(r, args.x)], _metric(r, key, p)) for r in runs]
                    pts = [(x, y) for x, y in pts if y is not None]
                    if pts:
                        ax.plot(
                            [x for x, _ in pts],
                            [y for _, y in pts],
                            marker=MARKERS[j % len(MARKERS)],
                            linestyle=LINESTYLES[j % len(LINESTYLES)],
                            color=colors[i % len(colors)],
                            label=f"{name} {word}",
                        )
            setup_x(ax)
        ax.set_title(title + label)
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        if ax.lines or ax.patches:
            ax.legend(fontsize=7, handlelength=3.5)
    save(fig, "latency.png")

    for p in written:
        print(p)
    return 0
