"""The engine's CPU backend: C++ kernels for float32, with the torch references as their fallback.

Decode attention is most of a CPU decode step, and the reference spends it gathering every sequence's
blocks into a padded batch; ``kernels/csrc/paged_attention_cpu.cpp`` reads the blocks in place instead,
from a float32 or an FP8 (e4m3) cache. The
norms, SiLU-and-mul and rotary embedding (``kernels/csrc/elementwise_cpu.cpp``) are one pass each instead of
five to ten ATen ops, which at decode batch sizes cost more than their arithmetic. Prefill attention and
the KV store stay the references (SDPA's flash kernel and ``index_copy_`` are already good). The
mixture-of-experts MLP is a grouped torch path (``fused_moe`` below), not the reference's loop, and so
is batched LoRA (``lora_shrink`` / ``lora_expand``): one matmul per adapter slot, not a weight copy per token.

The C++ is built ahead of time, one library per ISA level, and this process loads the best level its CPU
has (kernels/cpu_build.py, kernels/cpu_features.py); a source checkout without that build compiles its
level once into the user cache. Where neither works, or for dtypes other than float32, the references
run, so this module always works (the engine then picks the ``torch`` backend outright: server/backend.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import reference
from .cpu_build import KernelLibrary, library_for
from .cpu_features import cpu_features
from .reference import fp8_matmul, paged_attention_prefill, store_kv_cache

__all__ = [
    "apply_rotary",
    "fp8_matmul",
    "fused_add_rms_norm",
    "fused_moe",
    "gguf_dense_weight",
    "gguf_matmul",
    "load_extension",
    "lora_expand",
    "lora_shrink",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "silu_and_mul",
    "store_kv_cache",
    "w8a16_matmul",
]

logger = logging.getLogger(__name__)
# Rows above which w8a16_matmul dequantizes the matrix and runs the fp32 GEMM. Measured here
# (benchmarks/quantized_linear.py, benchmarks/README.md): the C++ kernel is 1.6-2.9x oneDNN fp32 at one
# row, on par at 32, 0.8-1.0x at 64, while dequantizing costs 1.3-15x a 64-row product; at prefill
# sizes (thousands of rows) the dequantization is a few percent of the GEMM.
W8A16_MAX_NATIVE_ROWS = 128


@functools.cache  # every kernel call asks (_native): one lookup, not two calls
def load_extension() -> Any | None:
    """This CPU's build of the C++ ops (kernels/cpu_build.py) as ``torch.ops.pagedserve``, or ``None``."""
    return None if loaded_library() is None else torch.ops.pagedserve


@functools.cache
def loaded_library() -> KernelLibrary | None:
    """The kernel library this process runs, loaded once: prebuilt, or built now into the user cache;
    ``None`` where neither works (no compiler, a read-only cache), and the torch references run."""
    features = cpu_features()
    try:
        library = library_for(features)
        torch.ops.load_library(str(library.path))
    except Exception as error:
        logger.warning("CPU kernels unavailable, using the torch references: %s", error)
        return None
    logger.info("CPU kernels: the %s build (%s; this CPU: %s)", library.level, library.origin,
                features.describe())
    return library


def _native(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> Any | None:
    """The compiled ops when every tensor is on the CPU in one of ``dtypes``, else ``None``."""
    if all(t.dtype in dtypes and t.device.type == "cpu" for t in tensors):
        return load_extension()
    return None


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.paged_attention_decode``."""
    # The C++ reads float32 and FP8 caches (an FP8 one at a quarter of the bytes), with float32 queries.
    fp8_cache = k_cache.dtype == reference.FP8_KV_DTYPE and v_cache.dtype == reference.FP8_KV_DTYPE
    ops = _native(q) if fp8_cache and k_cache.device.type == "cpu" else _native(q, k_cache, v_cache)
    if ops is None:
        return reference.paged_attention_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, logit_softcap,
            k_scale, v_scale,
        )
    tables, lens = block_tables.to(torch.int32), context_lens.to(torch.int32)
    # The C++ op's 0 means "none" for both.
    # Host floats: the scales live on the CPU here and no CUDA graph captures this op.
    k_scale_value = 1.0 if k_scale is None or not fp8_cache else float(k_scale)
    v_scale_value = 1.0 if v_scale is None or not fp8_cache else float(v_scale)
    return ops.paged_attention_decode(
        q, k_cache, v_cache, tables, lens, scale, sliding_window or 0, logit_softcap or 0.0, k_scale_value,
        v_scale_value,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = _native(x, weight)
    return reference.rms_norm(x, weight, eps) if ops is None else ops.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ops = _native(x, residual, weight)
    if ops is None:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    return ops.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    ops = _native(q, k, cos_sin_cache)
    if ops is None:
        return reference.apply_rotary(q, k, positions, cos_sin_cache)
    return ops.apply_rotary(q, k, positions, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.silu_and_mul``, in float32 or bfloat16: the bfloat16 gate/up rows of
    ``dense_matmul`` go to the down projection's as bfloat16, with no float32 copy in between."""
    ops = _native(x, dtypes=(torch.float32, torch.bfloat16))
    return reference.silu_and_mul(x) if ops is None else ops.silu_and_mul(x)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``reference.fused_moe``, grouped: the (token, slot) pairs are sorted by expert
    once and their rows gathered once, and the counts are read on the host once, so each expert that
    got tokens runs its two matmuls on a contiguous slice; experts with none cost nothing. The reference
    instead scans ``topk_ids`` and gathers rows per expert (``E`` scans and host reads per layer), which
    dominates at decode batch sizes with many experts (benchmarks/moe_layer.py)."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    rows = hidden.index_select(0, tokens)
    expert_out = torch.empty((rows.shape[0], w2.shape[1]), dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            block = rows[start:start + count]
            gate_up = F.linear(block, w13[expert])
            expert_out[start:start + count] = F.linear(silu_and_mul(gate_up), w2[expert])
        start += count
    weighted = expert_out.float() * topk_weights.reshape(-1)[order, None].float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, tokens, weighted).to(hidden.dtype)

# Rows from which gguf_matmul multiplies by the layer's dense copy of its blocks (gguf_dense_weight), where
# it has one, by the copy's dtype. Measured on the embedded model's 121 GGUF projections and head summed over
# a decode step (`python -m pagedserve.benchmarks.quantized_linear --gguf-step`, 2 threads; benchmarks/
# README.md, "Packed bfloat16 copies" and "Every x86-64 CPU"): with AVX512-BF16 the int8 kernel reads 4.5
# bits a weight against 16 and wins on bytes up to 6 rows (1 row: 12.8 against 23.1 ms; 6 rows 22.2 against
# 24.5); from 8 rows the product is compute-bound and oneDNN's bfloat16 GEMM on the packed copy wins (8 rows:
# 22.6 against 24.4 ms; 16 rows 28.3 against 41.4). A float32 copy on AVX2 draws level at 16 rows (50.0
# against 51.1 ms) and wins from 20 (57.0 against 57.8; 32 rows 70.7 against 84.7).
GGUF_DENSE_ROWS = {torch.bfloat16: 8, torch.float32: 16}


def w8a16_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as ``reference.w8a16_matmul``: ``kernels/csrc/w8a16_cpu.cpp`` for decode-sized
    batches; for more rows the matrix is dequantized once and the fp32 GEMM runs (compute-bound there,
    where the dequantization's ``N * K`` work is small beside the ``M * N * K`` product)."""
    ops = _native(x, scale, *(() if bias is None else (bias,)))
    if ops is None:
        return reference.w8a16_matmul(x, weight, scale, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > W8A16_MAX_NATIVE_ROWS:
        out = F.linear(x2, weight.to(torch.float32) * scale[:, None], bias)
    else:
        out = ops.w8a16_matmul(x2, weight, scale, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def gguf_dense_weight(
    qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, qtype: int
) -> torch.Tensor | None:
    """The blocks as a dense ``[N, K]`` matrix in ``dense_dtype()`` for ``gguf_matmul``'s batched products:
    ``reference.dequantize_gguf``, rounded to bfloat16 (bit for bit) where the CPU multiplies bfloat16
    natively, float32 elsewhere; None where the kernels or oneDNN are missing. The bfloat16 copy costs 2
    bytes a weight beside the blocks' 0.56 (Q4_1), the float32 one 4: the price of batched rows as fast
    as a float32 model's on a CPU without a bfloat16 dot product (on AVX2 the int8 kernel multiplies each
    row apart, 1.7-1.9x oneDNN's float32 GEMM at 64 rows; benchmarks/README.md)."""
    ops = load_extension()
    if ops is None or qs.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if dense_dtype() == torch.bfloat16:
        dense = ops.gguf_dequantize_bf16(qs, scales, mins, qtype)
    else:
        dense = reference.dequantize_gguf(qs, scales, mins, qtype)
    # Packed once into oneDNN's blocked layout (an opaque mkldnn tensor; ``.to_dense()`` gives the matrix
    # back): given a plain matrix, oneDNN repacks it inside every call. Same products bit for bit, 1.2x
    # faster at 64 rows and 2x at 8 here (benchmarks/README.md, "Packed bfloat16 copies"). The batch-size
    # hint only picks among layouts that measured alike from 1 to 256 rows.
    return torch.ops.mkldnn._reorder_linear_weight(dense, 64)


def dense_dtype() -> torch.dtype:
    """The dtype of ``gguf_dense_weight``'s copies: bfloat16 where oneDNN multiplies it natively
    (AVX512-BF16 or AMX), float32 elsewhere (oneDNN emulates bfloat16 there, no faster than float32, or on
    AVX2 has no bfloat16 inner product at all)."""
    return torch.bfloat16 if cpu_features().native_bf16 else torch.float32


def gguf_matmul(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    qtype: int,
    bias: torch.Tensor | None = None,
    dense: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.gguf_matmul`` below ``GGUF_DENSE_ROWS[dense.dtype]`` rows, or with no
    ``dense``: ``kernels/csrc/gguf_cpu.cpp``. From that many rows, given the layer's ``dense`` copy
    (``gguf_dense_weight``), ``dense_matmul``: the dequantized product, finer than the kernel's int8
    activation blocks. With a bfloat16 copy ``x`` (float32 or bfloat16) is rounded to bfloat16, summed in
    float32 and left in bfloat16 (oneDNN's output takes its inputs' dtype), or float32 with a bias added, as a
    bfloat16 model computes it; its caller converts, or hands the bfloat16 rows to the next product as they
    are (server/layers/linear.py ``Linear.forward``). With a float32 copy it is the float32 product."""
    x2 = x.reshape(-1, x.shape[-1])
    batched = dense is not None and x2.shape[0] >= GGUF_DENSE_ROWS[dense.dtype]
    if batched and x.dtype in (torch.float32, torch.bfloat16):
        out = dense_matmul(x2, dense, bias)
    else:
        ops = _native(x, *(() if bias is None else (bias,)))
        if ops is None or qs.device.type != "cpu":
            return reference.gguf_matmul(x, qs, scales, mins, qtype, bias)
        out = ops.gguf_matmul(x2, qs, scales, mins, qtype, bias)
    return out.view(*x.shape[:-1], qs.shape[0])


def dense_matmul(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """2-D ``x`` rounded to ``dense``'s dtype times ``dense`` (packed or plain), through oneDNN: float32 for a
    float32 copy; for a bfloat16 one bfloat16, or float32 with the bias added."""
    if dense.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x.float(), dense, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), dense, None, "none", [], "")
    return out if bias is None else out.float().add_(bias)


@dataclass(frozen=True)
class _SlotRuns:
    """A batch's adapter tokens in runs of one slot, read on the host once per step.

    The runner puts a step's requests in adapter order (server/worker/model_runner.py), so each slot's
    tokens are one or two contiguous row ranges (its decodes, then its prefills) and every run is a slice
    of ``x`` and ``y``: no gather, no scatter. A batch cut into more runs than that (another caller's
    order) is gathered by slot first: then runs index ``gathered`` rows, not rows of ``x``."""

    runs: list[tuple[int, int, int]]  # (slot, start, stop) per run of adapter tokens
    gathered: torch.Tensor | None  # int64 rows of x sorted by slot, or None: runs are rows of x


# The last grouping: every projection of a step reads the same slots (LoRAMapping, set once per step), so
# they are grouped once, not 2 x projections x layers times; reading them back is all a call repeats.
_last_runs: tuple[list[int], torch.device, _SlotRuns] | None = None


def _slot_runs(token_slots: torch.Tensor) -> _SlotRuns:
    global _last_runs
    # The slots as a Python list: a decode batch's few ids cost under a microsecond to read and compare,
    # against 5-10 us for bincount or aminmax and their host reads (benchmarks/lora_ops.py's sizes).
    slots = token_slots.tolist()
    last = _last_runs
    if last is not None and last[0] == slots and last[1] == token_slots.device:
        return last[2]
    grouped = _group_slots(slots, token_slots)
    _last_runs = (slots, token_slots.device, grouped)
    return grouped


def _group_slots(slots: list[int], token_slots: torch.Tensor) -> _SlotRuns:
    runs, start = [], 0
    for slot, tokens in itertools.groupby(slots):
        stop = start + sum(1 for _ in tokens)
        if slot >= 0:
            runs.append((slot, start, stop))
        start = stop
    present = sorted({slot for slot, _, _ in runs})
    if len(runs) <= 2 * len(present):
        return _SlotRuns(runs, None)
    runs, start = [], 0
    for slot in present:
        count = slots.count(slot)
        runs.append((slot, start, start + count))
        start += count
    order = torch.argsort(token_slots, stable=True)  # base-model tokens (-1) first, then slot by slot
    return _SlotRuns(runs, order[len(slots) - start:])


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.lora_shrink``, in runs of one slot (``_SlotRuns``): one matmul per run,
    written straight into its rows of the result. The reference gathers a ``[T, R, in]`` copy of the
    weights instead, which at prefill sizes costs far more than the product (benchmarks/lora_ops.py).
    Computed in float32, as the reference is. ``torch.mm`` (MKL) rather than server/layers/linear.py's
    oneDNN ``linear``: with weights it has not prepared before, oneDNN spends about 15 us per call
    preparing them, 6x a rank-16 product."""
    grouped = _slot_runs(token_slots)
    rows = x.float() if grouped.gathered is None else x.index_select(0, grouped.gathered).float()
    covered = sum(stop - start for _, start, stop in grouped.runs)  # rows no run writes stay zero
    make = torch.empty if covered == rows.shape[0] else torch.zeros
    buf = make((rows.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, start, stop in grouped.runs:
        torch.mm(rows[start:stop], lora_a[slot].float().t(), out=buf[start:stop])
    if grouped.gathered is None:
        return buf
    result = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    return result.index_copy_(0, grouped.gathered, buf)


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``reference.lora_expand``, in runs of one slot as ``lora_shrink``; base-model rows
    are not written. A float32 ``y`` takes each run's product added in the same call (``addmm_``); other
    dtypes get each delta rounded to ``y``'s dtype before it is added, as in the reference."""
    grouped = _slot_runs(token_slots)
    if grouped.gathered is not None:
        rows = buf.index_select(0, grouped.gathered).float()
        delta = torch.empty((rows.shape[0], lora_b.shape[1]), dtype=torch.float32, device=y.device)
        for slot, start, stop in grouped.runs:
            torch.mm(rows[start:stop], lora_b[slot].float().t(), out=delta[start:stop])
        return y.index_add_(0, grouped.gathered, delta.to(y.dtype))
    for slot, start, stop in grouped.runs:
        weight = lora_b[slot].float().t()
        if y.dtype == torch.float32:
            y[start:stop].addmm_(buf[start:stop].float(), weight)
        else:
            y[start:stop].add_(torch.mm(buf[start:stop].float(), weight).to(y.dtype))
    return y
