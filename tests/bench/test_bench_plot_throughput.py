"""`pagedserve bench plot` writes real PNG images; `pagedserve bench throughput` on a tiny workload."""

from __future__ import annotations

import json

import pytest
from pagedserve.benchmarks import plot, throughput

from pagedserve.testing.bench_helpers import bench_args


def fake_run(conc, out_tps, ttft, label=None):
    run = {
        "label": label, "max_concurrency": conc, "request_rate": "inf", "num_prompts": 32,
        "output_throughput": out_tps, "request_throughput": out_tps / 64, "completed": 32,
    }  # fmt: skip
    for i, key in enumerate(("ttft", "tpot", "itl", "e2el")):
        base = ttft / (i + 1)
        run[f"median_{key}_ms"] = run[f"p50_{key}_ms"] = base
        run[f"p90_{key}_ms"] = base * 1.5
        run[f"p99_{key}_ms"] = base * 2
    return run


def test_plot_writes_pngs(tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image")
    sweep = tmp_path / "engine.json"
    sweep.write_text(json.dumps([fake_run(c, 50 * c**0.7, 100 + 20 * c) for c in (1, 4, 16)]))
    single = tmp_path / "single.json"
    single.write_text(json.dumps(fake_run(None, 300.0, 900.0, label="unbounded")))
    out = tmp_path / "plots"
    assert plot.run(bench_args(plot, [str(sweep), str(single), "--out", str(out), "--title", "test"])) == 0
    for name in ("throughput.png", "latency.png"):
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib_image.imread(str(path))
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
        assert img.std() > 0.01  # not a blank canvas
    args = bench_args(plot, [str(sweep), "--out", str(out / "rate"), "--x", "request-rate"])
    assert plot.run(args) == 0 and (out / "rate" / "latency.png").exists()
    # one run per file at the same concurrency (one run per setup): grouped bars
    files = []
    for name, tps in (("single", 20.0), ("prefix-hash", 30.0), ("round-robin", 15.0)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(fake_run(8, tps, 1000.0 / tps, label=name)))
    assert plot.run(bench_args(plot, [*map(str, files), "--out", str(out / "bars")])) == 0
    img = matplotlib_image.imread(str(out / "bars" / "throughput.png"))
    assert img.ndim == 3 and img.std() > 0.01


def test_plot_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert plot.run(bench_args(plot, [str(bad), "--out", str(tmp_path / "o")])) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_throughput_tiny_against_hf(tmp_path, capsys):
    out = tmp_path / "tp.json"
    args = bench_args(
        throughput,
        ["--num-prompts", "3", "--input-len-range", "4:12", "--output-len-range", "2:5", "--compare",
         "hf,float-weights", "--hf-batch-size", "2", "--result-json", str(out)],
    )  # fmt: skip
    assert throughput.run(args) == 0
    res = json.loads(out.read_text())
    requested = sum(n for _, n in throughput.build_workload(_tokenizer(res["model"]), args))
    assert res["pagedserve"]["output_tokens"] == requested
    assert res["hf"]["output_tokens"] == res["hf"]["counted_output_tokens"] == requested
    assert res["hf"]["generated_tokens"] >= requested
    assert res["speedup_output_tokens_per_second"] > 0
    # The default mode (gguf, the embedded model's) against its float weights, the same prompts
    assert res["pagedserve"]["quantization"] == "gguf" and res["float_weights"]["quantization"] is None
    assert res["float_weights"]["output_tokens"] == requested and res["speedup_over_float_weights"] > 0
    text = capsys.readouterr().out
    assert "pagedserve   Throughput:" in text and "HF           Throughput:" in text and "Speed-up" in text
    assert "float wts    Throughput:" in text


def test_throughput_refuses_an_unknown_side() -> None:
    with pytest.raises(SystemExit):
        bench_args(throughput, ["--compare", "hf,vllm"])


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
