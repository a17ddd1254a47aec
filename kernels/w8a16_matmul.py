"""Weight-only INT8 matmul (w8a16): ``x @ (weight * scale[:, None]).T + bias`` with int8 weights.

Decode on a GPU is memory-bound on the weights; int8 halves the bytes of bf16. Each program computes a
``BLOCK_M x BLOCK_N`` output tile: it loads int8 weight tiles, widens them to the activation dtype in
registers (int8 values are exact in bf16/fp16) and accumulates ``tl.dot`` in float32; the per-output-
channel scale and the bias are applied once, to the accumulator. Up to ``split_k.ROWS`` rows (decode)
K is split across programs too (kernels/split_k.py), with a launch tuned per GPU and weight shape where
kernels/configs/w8a16_decode.json has one (benchmarks/gpu/tune_w8a16.py writes it, as vLLM's
benchmark_moe.py writes its fused-MoE configs). The reference is
``pagedserve.kernels.reference.w8a16_matmul``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from . import split_k
from ._triton_utils import next_pow2

BLOCK_M_MAX = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
TUNED_LAUNCHES = Path(__file__).parent / "configs" / "w8a16_decode.json"


@dataclass(frozen=True)
class DecodeLaunch:
    """The split-K launch of up to ``split_k.ROWS`` rows. The default: narrower column tiles than the
    batched launch, longer K steps, deeper pipelining."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = split_k.PROGRAMS_PER_SM
    # The last split of each tile to finish adds the partial sums up itself (split_k.py's ticket), in
    # place of a second launch.
    fused_reduce: bool = False


@functools.cache
def _tuned(device_name: str) -> dict[str, DecodeLaunch]:
    """``"NxK"`` -> launch, for one GPU model, from TUNED_LAUNCHES (none where it has no entry)."""
    table = json.loads(TUNED_LAUNCHES.read_text()) if TUNED_LAUNCHES.exists() else {}
    return {shape: DecodeLaunch(**launch) for shape, launch in table.get(device_name, {}).items()}


@functools.cache
def decode_launch(n: int, k: int, device: torch.device) -> DecodeLaunch:
    """The tuned launch for an ``[n, k]`` weight on this GPU, else the default (looked up once)."""
    if device.type != "cuda":
        return DecodeLaunch()
    return _tuned(torch.cuda.get_device_name(device)).get(f"{n}x{k}", DecodeLaunch())


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FUSED_REDUCE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_tile = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]: W.T
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        x = tl.load(x_tile + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile + k0, mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    if PARTIAL:  # split_k.reduce_partials, or the tile's last split, scales, adds the bias and casts
        part = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(part + split.to(tl.int64) * M * N, acc, mask=tile_ok)
        if FUSED_REDUCE:
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if split_k.last_to_finish(ticket_ptr + tile, tl.num_programs(2)):
                acc = split_k.sum_partials(part, M * N, tl.num_programs(2), tile_ok, BLOCK_M, BLOCK_N)
                _epilogue(acc, scale_ptr, bias_ptr, out, cols, col_ok, tile_ok, HAS_BIAS)
    else:
        _epilogue(acc, scale_ptr, bias_ptr, out, cols, col_ok, tile_ok, HAS_BIAS)


@triton.jit
def _epilogue(acc, scale_ptr, bias_ptr, out, cols, col_ok, tile_ok, HAS_BIAS: tl.constexpr):
    """The per-channel scale and the bias on the float32 sums, cast, stored."""
    acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out, acc.to(out.dtype.element_ty), mask=tile_ok)


def w8a16_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` ``[..., K]`` (float), ``weight`` int8 ``[N, K]``, ``scale`` ``[N]``, ``bias`` ``[N]`` or
    None -> ``[..., N]`` in ``x``'s dtype."""
    return w8a16_matmul_with(x, weight, scale, bias, launch=None)


def w8a16_matmul_with(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    launch: DecodeLaunch | None,
) -> torch.Tensor:
    """``w8a16_matmul`` with the split-K launch of a few rows given (benchmarks/gpu/tune_w8a16.py tries
    them); ``None``: the tuned one."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    (m, k), n = x2.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not (m and n):
        return out.view(*x.shape[:-1], n)
    if m <= split_k.ROWS:  # tl.dot needs at least 16 rows
        launch = launch or decode_launch(n, k, x.device)
        block_m, block_n, block_k = max(16, next_pow2(m)), launch.block_n, launch.block_k
        tuning = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        splits, per_split = split_k.plan(n, k, block_n, block_k, x.device, launch.programs_per_sm)
        fused = splits > 1 and launch.fused_reduce
    else:
        block_m, block_n, block_k = min(BLOCK_M_MAX, next_pow2(m)), BLOCK_N, BLOCK_K
        tuning = {"num_warps": NUM_WARPS}
        splits, per_split, fused = 1, k, False
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    _w8a16_kernel[grid](
        x2, weight, scale, bias if bias is not None else scale, out, parts,
        split_k.tickets(x.device, grid[0] * grid[1]) if fused else scale,  # never read unless fused
        m, n, k, per_split,
        x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, FUSED_REDUCE=fused,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **tuning,
    )  # fmt: skip
    if splits > 1 and not fused:
        split_k.reduce_partials(parts, scale, bias, out)
    return out.view(*x.shape[:-1], n)
