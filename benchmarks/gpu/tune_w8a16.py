"""Tune the w8a16 matmul's split-K decode launch per weight shape on this GPU, and record the winners.

For each of Llama-3-8B's projection shapes and its LM head, every launch in ``CANDIDATES`` (tile width,
K step, pipeline stages, programs per SM, the partial sums reduced by a second launch or by the last
split) multiplies one row by int8 weights, timed in CUDA graphs over weight copies larger than L2 (as
benchmarks/gpu/quantized_linear.py's rotation); a launch whose output differs from the default's, before
or after its timing, by more than the rounding of another summation order is refused. The fastest
launch that beats the default by ``MIN_GAIN`` goes into kernels/configs/w8a16_decode.json under this
GPU's name (other GPUs' entries are kept), which ``w8a16_matmul`` reads at its next start; every trial
goes to ``$OUT/tune_w8a16.json``.

    python -m pagedserve.benchmarks.gpu.tune_w8a16 [--out DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict

import torch
from pagedserve.benchmarks.gpu.common import copy_bandwidth, device_info, graph_time, write_result
from pagedserve.benchmarks.gpu.quantized_linear import SHAPES, copies_beyond_l2, dense_weight
from pagedserve.kernels.w8a16_matmul import TUNED_LAUNCHES, DecodeLaunch, w8a16_matmul_with
from pagedserve.server.layers.quantization.int8 import quantize_per_channel

# The first run on an H200 (24 compiles x 4 programs-per-SM) chose 4 warps, 3 stages and 256-wide K steps
# for every shape: the grid now spends its compiles around there, and on the fused reduction.
CANDIDATES = [
    DecodeLaunch(block_n, block_k, 4, stages, per_sm, fused)
    for block_n, block_k, stages, per_sm, fused in itertools.product(
        (16, 32, 64), (128, 256, 512), (2, 3), (1, 2, 4, 8), (False, True)
    )
]
# Llama-3-8B's projections, and its LM head (int8 mode quantizes the head too).
TUNED_SHAPES = [*SHAPES, ("lm_head", 128256, 4096)]
MIN_GAIN = 0.03  # a launch must beat the default by this fraction: smaller gains are timing noise
MAX_REL_DIFF = 1e-2  # of the output's largest magnitude; bf16 output rounding of other sum orders


def int8_copies(n: int, k: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Copies of one ``[n, k]`` int8 weight and its scales (quantized_linear.py's weights and rotation),
    together more than any L2; each one's bytes."""
    gen = torch.Generator().manual_seed(0)
    nbytes = n * k + n * 4
    return [quantize_per_channel(dense_weight(n, k, gen)) for _ in range(copies_beyond_l2(nbytes))], nbytes


def tune_shape(n: int, k: int, copy_bw: float) -> tuple[dict, list[dict]]:
    """The fastest correct launch for one ``[n, k]`` weight at one row (its trial), and every trial."""
    copies, nbytes = int8_copies(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    default = DecodeLaunch()
    expected = w8a16_matmul_with(x, *copies[0], None, default).float()
    trials = []
    for launch in [default, *[c for c in CANDIDATES if c != default]]:
        row = asdict(launch)
        try:
            diff = (w8a16_matmul_with(x, *copies[0], None, launch).float() - expected).abs().max()
            seconds = graph_time([lambda w=w, launch=launch: w8a16_matmul_with(x, *w, None, launch)
                                  for w in copies])
            after = (w8a16_matmul_with(x, *copies[0], None, launch).float() - expected).abs().max()
            largest = max(expected.abs().max().item(), 1e-6)
            row["rel_diff_vs_default"] = max(diff.item(), after.item()) / largest
            row.update(microseconds=seconds * 1e6, weight_bw_fraction=nbytes / seconds / copy_bw)
        except Exception as exc:  # e.g. out of shared memory for a large tile
            row["error"] = repr(exc)[:200]
        trials.append(row)
    ok = [t for t in trials if "microseconds" in t and t["rel_diff_vs_default"] <= MAX_REL_DIFF]
    best = min(ok, key=lambda t: t["microseconds"])
    if best["microseconds"] > trials[0]["microseconds"] * (1 - MIN_GAIN):
        best = trials[0]
    del copies
    torch.cuda.empty_cache()
    return best, trials


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-write", action="store_true", help=f"leave {TUNED_LAUNCHES.name} as it is")
    args = parser.parse_args()
    copy_bw = copy_bandwidth()
    info = device_info()
    result = {"benchmark": "w8a16 decode launch tuning, one row, CUDA graphs", "device": info,
              "copy_bandwidth_gbps": copy_bw / 1e9, "shapes": {}}
    chosen = {}
    fields = list(asdict(DecodeLaunch()))
    for shape, n, k in TUNED_SHAPES:
        best, trials = tune_shape(n, k, copy_bw)
        launch = {f: best[f] for f in fields}
        result["shapes"][shape] = {"n": n, "k": k, "chosen": best, "default": trials[0], "trials": trials}
        chosen[f"{n}x{k}"] = launch
        print(f"{shape:8s} default {trials[0]['microseconds']:7.1f} us -> {best['microseconds']:7.1f} us "
              f"({best['weight_bw_fraction']:.0%} of copy bandwidth) with {launch}", flush=True)
        write_result("tune_w8a16", result, args.out, echo=False)  # a run cut short keeps its shapes
        if not args.no_write:
            write_table(chosen)


def write_table(chosen: dict[str, dict[str, int]]) -> None:
    """This GPU's launches into TUNED_LAUNCHES, beside other GPUs' (its own old entries replaced)."""
    table = json.loads(TUNED_LAUNCHES.read_text()) if TUNED_LAUNCHES.exists() else {}
    table[torch.cuda.get_device_name()] = chosen
    TUNED_LAUNCHES.parent.mkdir(exist_ok=True)
    TUNED_LAUNCHES.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
