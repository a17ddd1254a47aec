"""server/worker/cuda_graphs.py on a GPU: decode graphs replay what the eager forward computes, for
batches that fill a bucket and batches padded into one; the profiling forward and the KV budget."""

import pytest
import torch
from pagedserve.benchmarks.gpu import random_model
from pagedserve.server.backend import select_backend
from pagedserve.server.layers.attention import AttentionMetadata
from pagedserve.server.loader import load_model
from pagedserve.server.worker.cuda_graphs import (
    DecodeGraphs,
    batch_buckets,
    kv_cache_budget,
    profile_activation_peak,
)
from pagedserve.server.worker.model_runner import ModelRunner

from pagedserve.testing.gpu import GPU, MODELS

pytestmark = GPU
CUDA = torch.device("cuda")
BLOCK_SIZE, MAX_MODEL_LEN, MAX_BATCH = 16, 2048, 16
NUM_BLOCKS = MAX_BATCH * MAX_MODEL_LEN // BLOCK_SIZE  # every sequence its own blocks: no slot shared


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.fixture(scope="module")
def engine_model():
    shape, overrides = MODELS["smollm2-shape"]
    path = random_model.cached_random_model(shape, **overrides)
    backend = select_backend(CUDA, torch.bfloat16, "triton")
    model, _ = load_model(path, torch.bfloat16, CUDA, backend=backend)
    # The runner binds a KV cache to every layer; random contents stand for earlier tokens.
    ModelRunner(model, backend, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim, torch.bfloat16,
                CUDA, enforce_eager=True)  # the test captures its own graphs
    for layer in model.attention_layers():
        layer.k_cache.normal_()
        layer.v_cache.normal_()
    return model


def decode_batch(batch: int, seed: int, vocab: int, max_context: int = MAX_MODEL_LEN):
    """A decode step whose block tables are as wide as one of the graphs' (same split-K partitions)."""
    gen = torch.Generator().manual_seed(seed)
    contexts = torch.randint(1, max_context, (batch,), generator=gen)
    width = max_context // BLOCK_SIZE
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[: batch * width].view(batch, width).int()
    positions = contexts - 1
    slots = tables[torch.arange(batch), positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots.to(CUDA), num_decode_tokens=batch, decode_block_tables=tables.to(CUDA),
        decode_context_lens=contexts.int().to(CUDA), prefill_block_tables=tables[:0].to(CUDA),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=CUDA),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=CUDA),
    )
    ids = torch.randint(0, vocab, (batch,), generator=gen).to(CUDA)
    return ids, positions.to(CUDA), meta


def test_graph_replay_equals_eager(engine_model):
    model = engine_model
    graphs = DecodeGraphs(model, model.backend, MAX_BATCH, MAX_MODEL_LEN, BLOCK_SIZE, CUDA)
    graphs.capture()
    assert graphs.widths == [256 // BLOCK_SIZE, 1024 // BLOCK_SIZE, MAX_MODEL_LEN // BLOCK_SIZE]
    with torch.inference_mode():
        # Full tables, then the narrow ones of short contexts (their own captures)
        cases = [(4, 0, MAX_MODEL_LEN), (3, 1, MAX_MODEL_LEN), (16, 2, MAX_MODEL_LEN), (11, 3, MAX_MODEL_LEN),
                 (1, 4, MAX_MODEL_LEN), (1, 5, 256), (8, 6, 256), (16, 7, 1024), (5, 8, 1024)]
        for batch, seed, max_context in cases:
            ids, positions, meta = decode_batch(batch, seed, model.vocab_size, max_context)
            assert graphs.fits(meta)
            # Eager first: the step's K/V land in the cache, and the replay writes the same values again.
            eager = model(ids, positions, meta).clone()
            replayed = graphs.run(ids, positions, meta).clone()
            if batch in graphs.buckets:  # the same kernels on the same shapes: the same bits
                torch.testing.assert_close(replayed, eager, atol=0, rtol=0)
            else:  # padded into a larger bucket: GEMMs of another shape may round differently
                torch.testing.assert_close(replayed, eager, atol=5e-2, rtol=5e-2)
                assert (replayed.float() - eager.float()).abs().mean() < 5e-3


def test_profiling_forward_and_kv_budget(engine_model):
    model = engine_model
    peak = profile_activation_peak(model, 4096, 64)
    hidden = model.config.hidden_size
    assert 4096 * hidden * 2 < peak < 4096 * hidden * 2 * 200
    budget = kv_cache_budget(CUDA, 0.9, peak)
    assert 0 < budget < torch.cuda.mem_get_info(CUDA)[1]
