"""CUDA graphs for decode-only steps, and the profiling forward that sizes the KV cache on a GPU.

How the engine uses them (server/engine/llm_engine.py, server/worker/model_runner.py):

* At start-up, before allocating the KV cache: ``peak = profile_activation_peak(model,
  max_num_batched_tokens, max_num_seqs)``, then ``kv_cache_budget(device, gpu_memory_utilization,
  peak)`` bytes of KV cache (num_blocks = budget // bytes_per_block).
* After the cache is bound, if the backend supports CUDA graphs (server/backend.py: Triton on CUDA) and
  ``enforce_eager`` is off: ``graphs = DecodeGraphs(model, backend, max_num_seqs, max_model_len,
  block_size, device); graphs.capture()``.
* Each step whose batch is decodes only and fits (``graphs.fits(meta)``): ``hidden =
  graphs.run(input_ids, positions, meta)`` instead of ``model(input_ids, positions, meta)``; logits
  and sampling stay outside the graph.

A graph is captured per batch-size bucket (1, 2, 4, then multiples of 8) and block-table width: as wide
as ``max_model_len`` needs and, for buckets up to 64, as 256 and 1,024 tokens need. A smaller batch runs
in the next bucket up, its padding rows given slot -1 (no KV write) and context 0 (the decode kernel
reads nothing and writes zeros for them); a step's tables run in the narrowest width that holds them.
The decode kernel sizes its launch from tensor shapes only (kernels/paged_attention_decode.py
``_partition``), so a capture serves every context up to its width; the narrow ones exist because a table
as wide as max_model_len cuts short contexts into split-K partitions that are nearly all empty, plus a
pass merging them.
"""

from __future__ import annotations

import torch
from pagedserve.server.backend import Backend
from pagedserve.server.layers.attention import AttentionMetadata
from torch import nn

NARROW_CONTEXTS = (256, 1024)  # tokens: the narrower tables graphs are captured for, ...
# ... at batch buckets up to this size only: above it the decode kernel gives an 8-KV-head model one
# partition per sequence at any width (kernels/paged_attention_decode.py PROGRAMS_PER_SM), and every
# graph holds its own output and pool blocks
NARROW_MAX_BATCH = 64


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: nn.Module, backend: Backend, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name} backend on {device} cannot run in CUDA graphs")
        self.model = model
        self.buckets = batch_buckets(max_num_seqs)
        self.width = -(-max_model_len // block_size)
        self.widths = sorted({min(-(-tokens // block_size), self.width) for tokens in NARROW_CONTEXTS}
                             | {self.width})
        n = self.buckets[-1]
        # Static inputs: every graph reads a prefix of these.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.no_prefill = torch.zeros(1, dtype=torch.int32, device=device)
        # (batch bucket, table width) -> graph, and the hidden states it leaves
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def _meta(self, batch: int, width: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch, :width],
            decode_context_lens=self.context_lens[:batch],
            prefill_block_tables=self.block_tables[:0],
            prefill_cu_seqlens_q=self.no_prefill,
            prefill_context_lens=self.context_lens[:0],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket and width, largest first, all in one memory pool."""
        pool = None
        for width in reversed(self.widths):
            for batch in reversed(self.buckets):
                if width != self.width and batch > NARROW_MAX_BATCH:
                    continue
                meta = self._meta(batch, width)
                self.model(self.input_ids[:batch], self.positions[:batch], meta)  # compile, warm up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self.model(self.input_ids[:batch], self.positions[:batch], meta)
                pool = graph.pool()
                self.graphs[batch, width] = graph
                self.outputs[batch, width] = output
        torch.cuda.synchronize()

    def fits(self, meta: AttentionMetadata) -> bool:
        return (meta.num_prefills == 0 and 0 < meta.num_decode_tokens <= self.buckets[-1]
                and meta.decode_block_tables.shape[1] <= self.width)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's hidden states ``[num_decodes, hidden]`` for a decode-only step (``fits(meta)``)."""
        batch = meta.num_decode_tokens
        bucket = next(b for b in self.buckets if b >= batch)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.block_tables[:batch, :width].copy_(meta.decode_block_tables)
        self.context_lens[:batch].copy_(meta.decode_context_lens)
        # Padding rows: no KV write, no context. (Table columns past a context are never read.)
        self.slot_mapping[batch:bucket].fill_(-1)
        self.context_lens[batch:bucket].zero_()
        tier = next(w for w in self.widths if w >= width)
        key = bucket, tier if (bucket, tier) in self.graphs else self.width
        self.graphs[key].replay()
        return self.outputs[key][:batch]


@torch.inference_mode()
def profile_activation_peak(model: nn.Module, num_tokens: int, num_seqs: int) -> int:
    """Bytes the largest step allocates beyond what is already allocated (weights): one prefill of
    ``num_tokens`` tokens plus logits for ``num_seqs`` rows, on the model's own kernels, run against a
    one-block placeholder cache (every block-table entry points at it; slot -1 writes nothing; the
    values are irrelevant)."""
    layers = model.attention_layers()
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    placeholder = torch.zeros(1, 16, layers[0].num_kv_heads, layers[0].head_dim, dtype=dtype, device=device)
    try:
        for layer in layers:
            layer.k_cache = layer.v_cache = placeholder
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
            prefill_block_tables=torch.zeros(1, -(-num_tokens // 16), dtype=torch.int32, device=device),
            prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            prefill_context_lens=lens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device) % getattr(model, "max_position", num_tokens)
        hidden = model(ids, positions, meta)
        model.compute_logits(hidden[-num_seqs:])
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - baseline
    finally:
        for layer, (k, v) in zip(layers, saved, strict=True):
            layer.k_cache, layer.v_cache = k, v
        torch.cuda.empty_cache()


def kv_cache_budget(device: torch.device, gpu_memory_utilization: float, activation_peak: int,
                    reserve: int = 1 << 30) -> int:
    """KV cache bytes: ``gpu_memory_utilization`` of the device, less what this process already holds
    (weights), what other users of the device hold, the activation peak, and ``reserve`` (CUDA graphs,
    allocator slack)."""
    free, total = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_reserved(device)
    others = total - free - ours
    allocated = torch.cuda.memory_allocated(device)
    return int(total * gpu_memory_utilization) - others - allocated - activation_peak - reserve
