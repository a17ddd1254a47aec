"""benchmarks/results/gpu.json and the results table of benchmarks/gpu/README.md, from one device run's
output folder (run_all.sh's ``$OUT``): its JUnit XML and the JSON each stage wrote. Runs anywhere, the
GPU not needed: a session fetches the folder and reports from it here.

    python -m pagedserve.benchmarks.gpu.report DIR [--json PATH] [--readme PATH] [--note TEXT]

A stage that did not run leaves its keys null, with the stage named under ``missing``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.gpu.junit_summary import read_junit

HERE = Path(__file__).resolve().parent
JSON_PATH = HERE.parent / "results" / "gpu.json"
README = HERE / "README.md"
BEGIN, END = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"
STEP_MODES = {"int8_weights": "_int8", "fp8_weights": "_fp8", "fp8_kv_cache": "_kv-fp8"}


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _tests(folder: Path) -> dict[str, Any] | None:
    path = folder / "tests.xml"
    if not path.is_file():
        return None
    result = read_junit(str(path))
    families = [line for line in result.failures if "test_greedy_matches_hf" in line]
    return {"passed": result.passed, "failed": len(result.failures), "skipped": result.skipped,
            "failures": result.failures, "model_family_failures_on_triton": len(families)}


def _prefill(data: dict | None) -> dict | None:
    if data is None:
        return None
    out = {f"d{dim}": {case: round(row["triton_tflops"], 1) for case, row in cases.items()}
           for dim, cases in data["head_dims"].items()}
    out.update({f"d{dim}_sdpa_flash": {case: round(row["sdpa_flash_tflops"], 1) for case, row in cases.items()
                                       if "sdpa_flash_tflops" in row}
                for dim, cases in data["head_dims"].items()})
    out["config"] = data["config"]
    if "sweep_4x4096" in data:
        out["sweep_best_4x4096"] = {dim: trials[0] for dim, trials in data["sweep_4x4096"].items() if trials}
    return out


def _quantized(data: dict | None) -> dict | None:
    if data is None:
        return None
    out: dict[str, Any] = {}
    for row in data["rows"]:
        if row["rows"] in (1, 16):
            entry = out.setdefault(f"{row['shape']}_rows{row['rows']}", {})
            entry[row["kernel"]] = {"microseconds": round(row["microseconds"], 1),
                                    "weight_bw_fraction": round(row["weight_bw_fraction"], 3),
                                    "time_over_bf16": round(row["time_over_bf16"], 3)}
    return out


def _tuning(data: dict | None) -> dict | None:
    """Per shape: the default launch's and the chosen launch's one-row time and bandwidth share."""
    if data is None:
        return None
    return {shape: {which: {"microseconds": round(row[which]["microseconds"], 1),
                            "weight_bw_fraction": round(row[which]["weight_bw_fraction"], 3)}
                    for which in ("default", "chosen")}
            for shape, row in data["shapes"].items()}


def _steps(folder: Path) -> tuple[dict | None, dict | None]:
    bf16 = _load(folder, "b_decode_step_roofline")
    if bf16 is None:
        return None, None
    base = bf16["step_seconds_median"]
    ratios = {}
    for name, suffix in STEP_MODES.items():
        data = _load(folder, f"b_decode_step_roofline{suffix}")
        if data is not None:
            ratios[name] = {"step_ms": round(data["step_seconds_median"] * 1e3, 3),
                            "time_over_bf16": round(data["step_seconds_median"] / base, 3),
                            "step_over_roofline": round(data["median_step_over_roofline"], 3)}
    step = {"step_ms": round(base * 1e3, 3), "roofline_ms": round(bf16["roofline_seconds"] * 1e3, 3),
            "step_over_roofline": round(bf16["median_step_over_roofline"], 3)}
    return step, ratios


def build(folder: Path, date: str, note: str | None = None) -> dict[str, Any]:
    """The summary of one run's folder; ``note``: what the reader must know of how the run relates to
    the committed code (kept in the JSON as is)."""
    sources = {p.name for p in folder.glob("*.json")} | {p.name for p in folder.glob("*.xml")}
    device = _load(folder, "environment") or {}
    errors = _load(folder, "kernel_errors")
    decode_step, quantized_steps = _steps(folder)
    busy = _load(folder, "d_gpu_busy_share")
    throughput = _load(folder, "c_throughput_vs_hf")
    summary = {
        "device": device.get("gpu"), "sms": device.get("sms"), "torch": device.get("torch"),
        "triton": device.get("triton"), "date": date,
        "tests": _tests(folder),
        "per_kernel_max_error": errors["kernels"] if errors else None,
        "prefill_attention_tflops": _prefill(_load(folder, "prefill_attention")),
        "quantized_linear": _quantized(_load(folder, "quantized_linear")),
        "w8a16_decode_tuning": _tuning(_load(folder, "tune_w8a16")),
        "decode_step_vs_roofline": decode_step,
        "quantized_steps_vs_bf16": quantized_steps,
        "gpu_busy_share_bs64": busy["gpu_busy_share"] if busy else None,
        "throughput_vs_hf": throughput.get("speedup_output_tokens_per_second") if throughput else None,
        "sources": sorted(sources),
        "note": note,
    }
    summary["missing"] = sorted(k for k, v in summary.items() if v is None and k != "note")
    return summary


def table(summary: dict[str, Any]) -> str:
    """The README's results table: one line a figure."""
    rows = [("device", f"{summary['device']} (torch {summary['torch']}, triton {summary['triton']}), "
                       f"{summary['date']}")]
    tests = summary["tests"]
    if tests:
        rows.append(("GPU tests (run_all.sh tests)",
                     f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"))
    prefill = summary["prefill_attention_tflops"]
    if prefill:
        for dim in ("d128", "d64"):
            cases = ", ".join(f"{case} {value}" for case, value in prefill.get(dim, {}).items())
            flash = ", ".join(f"{c} {v}" for c, v in prefill.get(f"{dim}_sdpa_flash", {}).items())
            rows.append((f"prefill attention {dim}, TFLOP/s",
                         f"{cases} (torch SDPA, its default backend: {flash})"))
    steps = summary["decode_step_vs_roofline"]
    if steps:
        rows.append(("batch-1 decode step, Llama-3-8B shape, bf16",
                     f"{steps['step_ms']} ms, {steps['step_over_roofline']}x the roofline"))
    for name, data in (summary["quantized_steps_vs_bf16"] or {}).items():
        rows.append((f"batch-1 step, {name.replace('_', ' ')}",
                     f"{data['step_ms']} ms, {data['time_over_bf16']}x the bf16 step"))
    for shape, kernels in (summary["quantized_linear"] or {}).items():
        if shape.endswith("_rows1"):
            cells = ", ".join(f"{k} {v['time_over_bf16']}x ({v['weight_bw_fraction']:.0%} of copy bw)"
                              for k, v in kernels.items() if k != "bf16")
            rows.append((f"{shape.removesuffix('_rows1')} projection, 1 row, time over bf16", cells))
    for shape, launches in (summary["w8a16_decode_tuning"] or {}).items():
        default, chosen = launches["default"], launches["chosen"]
        rows.append((f"w8a16 {shape}, 1 row, tuned launch",
                     f"{default['microseconds']} -> {chosen['microseconds']} us "
                     f"({chosen['weight_bw_fraction']:.0%} of copy bw)"))
    for key, label in (("gpu_busy_share_bs64", "GPU busy share, batch-64 decode"),
                       ("throughput_vs_hf", "offline throughput over HF")):
        if summary[key] is not None:
            rows.append((label, f"{summary[key]:.3g}"))
    if summary["missing"]:
        rows.append(("not measured in this run", ", ".join(summary["missing"])))
    lines = ["| measure | result |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def write_readme(readme: Path, markdown: str) -> None:
    text = readme.read_text()
    block = f"{BEGIN}\n{markdown}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n## Latest results\n\n" + block + "\n"
    readme.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--json", type=Path, default=JSON_PATH)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    parser.add_argument("--note", default=None, help="kept in the JSON: how the run relates to the code")
    args = parser.parse_args()
    summary = build(args.folder, args.date, args.note)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    write_readme(args.readme, table(summary))
    print(table(summary))


if __name__ == "__main__":
    main()
