"""The runner's persistent block table: each request's block ids in a row of its own, kept across steps
and updated by what changed (vLLM V1's BlockTable, vllm/v1/worker/block_table.py), not rebuilt from
Python lists every step.

A request keeps its row while it runs. Each step ``update`` compares the KV cache manager's list of the
request's blocks (server/core/kv_cache_manager.py ``req_block_ids``) with the row: the blocks appended since
are written, and only their rows are copied to the device copy. A list that is not the same object as
the row's (the request was preempted, its blocks freed, then admitted again) is written whole. Rows of
requests the manager no longer holds are taken back when a new request needs one.

Entries the manager later replaces in place (the null block over blocks a sliding window left behind,
``KVCacheManager``'s skipped blocks) keep their old ids here, as in vLLM: every attention kernel starts
at the first key the window shows, so they are never read (kernels/paged_attention_decode.py,
kernels/csrc/paged_attention_cpu.cpp, kernels/reference.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


class BlockTable:
    def __init__(self, num_rows: int, max_blocks_per_row: int, device: torch.device,
                 to_device: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``to_device``: copies a host tensor to ``device`` (the runner's, pinned and non-blocking on a
        GPU). On the CPU the host table is the table: nothing is copied."""
        self.host = np.zeros((num_rows, max_blocks_per_row), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.lists: list[list[int] | None] = [None] * num_rows  # the manager's list each row holds
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.device = device
        self.to_device = to_device
        self.device_table: torch.Tensor | None = None
        if to_device is not None:
            self.device_table = torch.zeros(self.host.shape, dtype=torch.int32, device=device)
        self.changed_rows: set[int] = set()  # written on the host since the device copy was made

    def update(self, request_ids: Sequence[str], block_ids: dict[str, list[int]]) -> np.ndarray:
        """The rows of these requests, their blocks as ``block_ids`` now has them."""
        rows = np.empty(len(request_ids), dtype=np.int64)
        row_of, lists = self.row_of, self.lists
        for index, request_id in enumerate(request_ids):
            blocks = block_ids[request_id]
            row = row_of.get(request_id)
            if row is None:
                row = self._take_row(request_id, block_ids)  # may grow the arrays: not held in locals
            if lists[row] is not blocks:  # a new list: written from its start
                lists[row] = blocks
                self._clear(row)
            if len(blocks) != self.num_blocks[row]:
                self._write(row, blocks)
            rows[index] = row
        self._copy_changed_rows()
        return rows

    def device_rows(self, rows: np.ndarray) -> torch.Tensor:
        """The given rows (one table row may be several rows of the step), as wide as the longest of
        them, on the device."""
        if self.device_table is None:
            return self.host_rows(rows)
        assert self.to_device is not None
        index = self.to_device(torch.from_numpy(rows))
        return self.device_table[:, :self._width(rows)].index_select(0, index)

    def host_rows(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.host[rows, :self._width(rows)])

    def _width(self, rows: np.ndarray) -> int:
        return int(self.num_blocks[rows].max()) if len(rows) else 0

    def block_of(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The block holding each position of its row's sequence (host side: the slot mapping's)."""
        return self.host[rows, positions // block_size]

    def _clear(self, row: int) -> None:
        """No blocks: the padding after a row's blocks is zeros (a past request may have had more)."""
        self.host[row] = 0
        self.num_blocks[row] = 0
        self.changed_rows.add(row)

    def _write(self, row: int, blocks: list[int]) -> None:
        first = int(self.num_blocks[row])
        if len(blocks) < first:  # never from the manager (its lists only grow); written whole if so
            self._clear(row)
            first = 0
        if len(blocks) > self.host.shape[1]:
            self._widen(len(blocks))
        self.host[row, first:len(blocks)] = blocks[first:]
        self.num_blocks[row] = len(blocks)
        self.changed_rows.add(row)

    def _take_row(self, request_id: str, block_ids: dict[str, list[int]]) -> int:
        if not self.free_rows:
            self._free_finished(block_ids)
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.row_of[request_id] = row
        self.lists[row] = None
        return row

    def _free_finished(self, block_ids: dict[str, list[int]]) -> None:
        """Rows of requests whose blocks the manager freed (finished, aborted or preempted)."""
        for request_id in [r for r in self.row_of if r not in block_ids]:
            row = self.row_of.pop(request_id)
            self.lists[row] = None
            self.free_rows.append(row)

    def _grow(self) -> None:
        """Twice the rows (more requests hold blocks at once than the table was made for)."""
        num_rows = self.host.shape[0]
        self._resize(2 * num_rows, self.host.shape[1])
        self.lists.extend([None] * num_rows)
        self.free_rows.extend(range(2 * num_rows - 1, num_rows - 1, -1))

    def _widen(self, num_blocks: int) -> None:
        """Room for a row of ``num_blocks`` (a table made narrower than max_model_len's blocks)."""
        self._resize(self.host.shape[0], max(num_blocks, 2 * self.host.shape[1]))

    def _resize(self, num_rows: int, width: int) -> None:
        host = np.zeros((num_rows, width), dtype=np.int32)
        old_rows, old_width = self.host.shape
        host[:old_rows, :old_width] = self.host
        self.host = host
        num_blocks = np.zeros(num_rows, dtype=np.int64)
        num_blocks[:old_rows] = self.num_blocks
        self.num_blocks = num_blocks
        if self.device_table is not None:  # copied whole below
            self.device_table = torch.zeros(host.shape, dtype=torch.int32, device=self.device)
            self.changed_rows.update(range(old_rows))

    def _copy_changed_rows(self) -> None:
        if self.device_table is None or not self.changed_rows:
            self.changed_rows.clear()
            return
        assert self.to_device is not None
        rows = np.fromiter(self.changed_rows, dtype=np.int64, count=len(self.changed_rows))
        self.changed_rows.clear()
        values = self.to_device(torch.from_numpy(self.host[rows]))
        self.device_table.index_copy_(0, self.to_device(torch.from_numpy(rows)), values)
