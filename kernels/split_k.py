"""Split-K for the w8a16 matmul's few-row (decode) launches (kernels/w8a16_matmul.py).

A decode step multiplies a handful of rows by each weight matrix: the weights are all there is to read,
and one program per column tile is too few programs to keep enough loads in flight (96 of them for
Llama-3-8B's qkv on an H200's 132 SMs read 1.5 TB/s of its 4.3). So the K dimension is split as well,
sized from the SM count as kernels/paged_attention_decode.py sizes its partitions: each program writes a
float32 partial sum ``[splits, M, N]``, and ``reduce_partials`` adds them in a fixed order (the result
does not depend on timing), applies the per-column scale and the bias, and casts. Or, without the second
launch (a few microseconds each, three times a layer): each program takes a ticket for its output tile
once its partial is written (``last_to_finish``), and the one holding the last adds the tile's partials
up in split order (``sum_partials``), so the sum is the same whichever program finishes last. The
tickets are a per-device counter array, reset by that last program: CUDA-graph safe, one stream.
Measured on an H200 (benchmarks/gpu/README.md): one row of Llama-3-8B's gate_up at 77% of the copy
bandwidth, where the unsplit kernel read 1.5 TB/s. Which launch each weight shape takes on a GPU is
tuned (kernels/configs/w8a16_decode.json). The GGUF-block matmul tried the same with several blocks a
step and read Q4_1 at 0.13 TB/s (its per-value scale loads), below its unsplit 0.46: it keeps its one
launch shape.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, num_sms

ROWS = 16  # up to this many rows a matmul takes its split-K launch
PROGRAMS_PER_SM = 4
MAX_TILES = 1 << 16  # output tiles of one launch that a ticket counter exists for


def plan(n: int, k: int, block_n: int, block_k: int, device: torch.device,
         programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """``(splits, k_per_split)``: enough ``block_n``-column programs to fill the device (about
    ``programs_per_sm`` per SM), each over whole ``block_k`` steps of K."""
    tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    splits = max(1, min(steps, triton.cdiv(programs_per_sm * num_sms(device), tiles)))
    per_split = triton.cdiv(steps, splits) * block_k
    return triton.cdiv(k, per_split), per_split


@functools.cache
def _tickets(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def tickets(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The device's ticket counters, all zero between launches."""
    if num_tiles > MAX_TILES:
        raise ValueError(f"{num_tiles} output tiles in one split-K launch; at most {MAX_TILES}")
    return _tickets(device)


@triton.jit
def last_to_finish(ticket_ptr, splits):
    """Whether this program is its tile's last split to finish; that one also resets the counter. The
    barrier orders every thread's partial-sum stores before the ticket (an acquire-release atomic at
    GPU scope), so the last program sees them all."""
    tl.debug_barrier()
    last = tl.atomic_add(ticket_ptr, 1) == splits - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0)
    return last


@triton.jit
def sum_partials(part, split_stride, splits, mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's partial sums added in split order; loads go to L2 (``.cg``), where the other
    programs' stores are, not to a stale L1 line."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, splits):
        acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        part += split_stride
    return acc


@triton.jit
def _reduce_kernel(
    part_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, stride_om,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + (split * M + row).to(tl.int64) * N + cols, mask=col_ok, other=0.0)
    acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def reduce_partials(
    parts: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """``out[m, n] = (sum over splits of parts[:, m, n]) * scale[n] + bias[n]``, in ``out``'s dtype."""
    splits, m, n = parts.shape
    block_n = min(1024, next_pow2(n))
    _reduce_kernel[(m, triton.cdiv(n, block_n))](
        parts, scale, bias if bias is not None else scale, out,  # the kernel never reads a missing bias
        m, n, out.stride(0),
        SPLITS=splits, HAS_BIAS=bias is not None, BLOCK_N=block_n,
    )  # fmt: skip
