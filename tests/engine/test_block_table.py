"""The runner's persistent block table (server/worker/block_table.py) against a table rebuilt from the KV
manager's lists each step: the same rows after appends, preemption (a new list), finished requests and
growth, with and without a device copy (here on the CPU: the copy's own code path, every row checked)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pagedserve.server.worker.block_table import BlockTable


def rebuilt(lists: list[list[int]]) -> torch.Tensor:
    """What the runner made before the table persisted: the lists, zero-padded to the longest."""
    width = max((len(blocks) for blocks in lists), default=0)
    table = torch.zeros((len(lists), width), dtype=torch.int32)
    for row, blocks in enumerate(lists):
        table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return table


@pytest.mark.parametrize("device_copy", [False, True])
def test_rows_equal_the_manager_lists_through_a_run(device_copy: bool) -> None:
    rng = random.Random(0)
    table = BlockTable(4, 3, torch.device("cpu"), (lambda t: t.clone()) if device_copy else None)
    manager: dict[str, list[int]] = {}  # request id -> its blocks, as KVCacheManager.req_block_ids
    next_id, next_block = 0, 1
    for _ in range(300):
        action = rng.random()
        if action < 0.15 or not manager:  # admit (a preempted request comes back with a new list)
            request_id = f"r{rng.randrange(next_id + 1)}"
            next_id += 1
            manager[request_id] = []
        elif action < 0.25:  # finish or preempt: the manager forgets its list
            manager.pop(rng.choice(sorted(manager)))
        for blocks in manager.values():  # some grow (past the table's first width, too)
            for _ in range(rng.choice([0, 0, 1, 2])):
                blocks.append(next_block)
                next_block += 1
        scheduled = rng.sample(sorted(manager), rng.randrange(len(manager) + 1)) if manager else []
        rows = table.update(scheduled, manager)
        expected = rebuilt([manager[r] for r in scheduled])
        assert torch.equal(table.device_rows(rows), expected)
        assert torch.equal(table.host_rows(rows), expected)
        if device_copy:  # every row in use is on the device as on the host
            assert table.device_table is not None
            used = np.array(sorted(table.row_of.values()), dtype=np.int64)
            assert torch.equal(table.device_table[used], torch.from_numpy(table.host[used]))
    assert table.host.shape[0] >= 4 and table.host.shape[1] > 3  # it grew and widened on the way


def test_the_slot_of_each_position_is_read_from_the_rows() -> None:
    table = BlockTable(2, 4, torch.device("cpu"))
    rows = table.update(["a", "b"], {"a": [7, 3], "b": [5]})
    positions = np.array([0, 17, 3])
    assert table.block_of(rows[[0, 0, 1]], positions, 16).tolist() == [7, 3, 5]


def test_only_the_appended_blocks_are_copied() -> None:
    """A decode step copies the rows that gained a block, not the table."""
    copied: list[torch.Tensor] = []

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        copied.append(tensor)
        return tensor.clone()

    table = BlockTable(8, 4, torch.device("cpu"), to_device)
    lists = {f"r{i}": [i + 1] for i in range(6)}
    table.update(sorted(lists), lists)
    copied.clear()
    lists["r2"].append(40)
    table.update(sorted(lists), lists)
    row_copies = [t for t in copied if t.dim() == 2]
    assert len(row_copies) == 1 and row_copies[0].tolist() == [[3, 40, 0, 0]]
