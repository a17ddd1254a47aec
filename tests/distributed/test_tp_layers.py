"""The tensor-parallel layers over a real 2-rank gloo group on 127.0.0.1: each rank holds its shard
(half the rows, half the columns, half the vocabulary) and the layer's output equals the whole layer's.

Both ranks run every check in one spawned process each (a process start costs seconds here); each test
then reads its check's outcome on both ranks.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from pagedserve.server.distributed.parallel_state import TensorParallel, building
from pagedserve.server.layers.linear import Linear, VocabEmbedding

from pagedserve.testing.net import free_port

SIZE = 2
F32 = torch.float32
CPU = torch.device("cpu")


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_column_parallel_merged_qkv(tp: TensorParallel) -> None:
    """q split in 2, k and v (one head each) held whole by both ranks: replicated KV heads."""
    q, k, v = _random(8, 6, seed=1), _random(4, 6, seed=2), _random(4, 6, seed=3)
    bias = _random(16, seed=4)
    with building(tp):
        layer = Linear(6, [8, 4, 4], True, F32, CPU, parallel="column", part_pieces=[2, 1, 1])
    for index, (weight, part_bias) in enumerate(zip((q, k, v), bias.split([8, 4, 4]), strict=True)):
        layer.load("weight", weight, index)
        layer.load("bias", part_bias, index)
    assert tuple(layer.weight.shape) == (4 + 4 + 4, 6)
    x = _random(3, 6, seed=5)
    full = x @ torch.cat([q, k, v]).T + bias
    mine = torch.cat([full[:, tp.rank * 4 : tp.rank * 4 + 4], full[:, 8:]], dim=1)
    torch.testing.assert_close(layer(x), mine)


def check_column_parallel_fused_checkpoint(tp: TensorParallel) -> None:
    """A checkpoint that ships gate and up fused (Phi-3) is cut per projection, then per rank."""
    fused = _random(12, 5, seed=6)
    with building(tp):
        layer = Linear(5, [6, 6], False, F32, CPU, parallel="column")
    layer.load("weight", fused)
    gate, up = fused.split([6, 6])
    rows = slice(tp.rank * 3, tp.rank * 3 + 3)
    torch.testing.assert_close(layer.weight, torch.cat([gate[rows], up[rows]]))


def check_row_parallel_all_reduce(tp: TensorParallel) -> None:
    """Each rank multiplies its half of the input; the sum over the ranks, plus the bias once."""
    weight, bias, x = _random(6, 8, seed=7), _random(6, seed=8), _random(3, 8, seed=9)
    with building(tp):
        layer = Linear(8, 6, True, F32, CPU, parallel="row")
    layer.load("weight", weight)
    layer.load("bias", bias)
    assert tuple(layer.weight.shape) == (6, 4)
    torch.testing.assert_close(layer(x[:, tp.rank * 4 : tp.rank * 4 + 4]), x @ weight.T + bias)


def check_vocab_parallel_embedding(tp: TensorParallel) -> None:
    """11 ids over 2 ranks: 6 rows each (the last rank's sixth is padding); every id looks up right."""
    weight = _random(11, 4, seed=10)
    with building(tp):
        embedding = VocabEmbedding(11, 4, F32, CPU)
    embedding.load("weight", weight)
    assert tuple(embedding.weight.shape) == (6, 4)
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    torch.testing.assert_close(embedding(ids), weight[ids])


def check_vocab_parallel_logits_gathered_to_driver(tp: TensorParallel) -> None:
    weight, hidden = _random(11, 4, seed=11), _random(3, 4, seed=12)
    with building(tp):
        head = VocabEmbedding(11, 4, F32, CPU)
    head.load("weight", weight)
    logits = head.as_head(hidden)
    if tp.is_driver:
        assert logits is not None
        torch.testing.assert_close(logits, hidden @ weight.T)
    else:
        assert logits is None


CHECKS: dict[str, Callable[[TensorParallel], None]] = {
    name.removeprefix("check_"): check for name, check in globals().items() if name.startswith("check_")
}


def _rank_main(rank: int, port: int, results: multiprocessing.Queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE,
                            timeout=timedelta(seconds=60))
    tp = TensorParallel(rank, SIZE, dist.group.WORLD)
    outcome: dict[str, str | None] = {}
    for name, check in CHECKS.items():
        try:
            check(tp)
            outcome[name] = None
        except Exception:
            outcome[name] = traceback.format_exc()
    results.put((rank, outcome))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, str | None]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank_main, args=(rank, port, results)) for rank in range(SIZE)]
    for process in ranks:
        process.start()
    try:
        return dict(results.get(timeout=120) for _ in ranks)
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_layer_on_two_ranks(outcomes: dict[int, dict[str, str | None]], check: str) -> None:
    for rank in range(SIZE):
        assert outcomes[rank][check] is None, f"rank {rank}:\n{outcomes[rank][check]}"
