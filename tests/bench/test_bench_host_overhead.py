"""benchmarks/host_overhead.py runs end to end on a tiny batch and reports figures that add up."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.benchmarks import host_overhead


def test_host_overhead_reports_the_decode_steps_of_a_tiny_batch(tmp_path: Path, capsys) -> None:
    out = tmp_path / "host.json"
    assert host_overhead.main(["--batch", "4", "--output-len", "6", "--profile",
                               "--top", "5", "--output", str(out)]) == 0
    (figures,) = json.loads(out.read_text())["offline"]
    assert figures["batch"] == 4 and figures["decode_steps"] == 5  # 6 tokens: the first comes with the prompt
    assert figures["wall_us_per_seq_step"] > figures["host_us_per_seq_step"] > 0
    assert abs(figures["host_us_per_seq_step"] + figures["forward_us_per_seq_step"]
               - figures["wall_us_per_seq_step"]) < 1e-6 * figures["wall_us_per_seq_step"] + 1e-9
    printed = capsys.readouterr().out
    assert "host µs per sequence-step" in printed and "| own time | share | calls | function |" in printed
