"""``kv_transfer_params``: what a request and a response carry between a prefill and a decode engine, in
vLLM's P/D shape (its NIXL and Mooncake connectors), parsed and checked once by the input processor
(server/engine/processor.py) into ``RemoteDecode`` or ``RemotePrefill``.

The router (router/proxy.py, ``--strategy pd``) sends the prompt to a prefill engine with
``{"do_remote_decode": true}`` and ``max_tokens`` 1; that engine keeps the prompt's blocks and answers
``RemotePrefill.as_params()``: where its blocks are (per rank: its transfer engine's session and each
layer's K and V addresses; the block ids, the same on every rank) and where to say they were read (its
side channel). Under tensor or pipeline parallelism each decode rank reads from the prefill rank of the
same number, which holds the same layers and heads when both engines split the model alike. The router
hands that to a decode engine with the client's own request, and the decode engine reads the blocks
instead of computing the prompt (server/core/mooncake_connector.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.server.exceptions import InvalidRequestError


@dataclass(frozen=True)
class KVLayout:
    """Where a registered cache lives: enough for a peer to read any of its blocks."""

    session: str  # "host:port" of the owner's transfer engine
    k_addrs: tuple[int, ...]  # each layer's K cache start
    v_addrs: tuple[int, ...]
    block_bytes: int  # one block of one layer's K (or V)

    def spans(self, blocks: list[int]) -> list[int]:
        """The start of every (layer, K then V, block) span, in the order a batched read pairs them."""
        pairs = zip(self.k_addrs, self.v_addrs, strict=True)
        return [base + block * self.block_bytes for layer in pairs for base in layer for block in blocks]


def block_runs(remote: list[int], local: list[int]) -> list[tuple[int, int, int]]:
    """(remote start, local start, length) of the runs of blocks consecutive on both sides: each run is
    one span per layer's K and V instead of one per block."""
    runs: list[list[int]] = []
    for r, lo in zip(remote, local, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == lo:
            runs[-1][2] += 1
        else:
            runs.append([r, lo, 1])
    return [(r, lo, n) for r, lo, n in runs]


@dataclass(frozen=True)
class RemoteDecode:
    """A prefill request (``do_remote_decode``): its blocks are kept for a decode engine when it ends."""


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request (``do_remote_prefill``): the prompt's KV sits in another engine's blocks."""

    request_id: str  # the prefill engine's request, named when its blocks are released
    block_ids: tuple[int, ...]  # the prompt's blocks there, in order
    num_tokens: int  # the prompt's length there: a decode request with another prompt reads nothing
    layouts: tuple[KVLayout, ...]  # each rank's cache there, in rank order
    side_channel: str  # "host:port" where the prefill engine hears that its blocks were read

    def as_params(self) -> dict[str, Any]:
        host, _, port = self.side_channel.rpartition(":")
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_request_id": self.request_id,
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "remote_host": host,
            "remote_port": int(port),
            "remote_ranks": [
                {"session": layout.session, "k_addrs": list(layout.k_addrs), "v_addrs": list(layout.v_addrs),
                 "block_bytes": layout.block_bytes}
                for layout in self.layouts
            ],
        }


KVTransfer = RemoteDecode | RemotePrefill


def parse_kv_transfer_params(params: Any) -> KVTransfer | None:
    """The request's role in a P/D pair, or None (no params, or neither flag set: an ordinary request).
    InvalidRequestError naming the field for anything malformed."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise _invalid("must be an object")
    decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if decode and prefill:
        raise _invalid("do_remote_decode and do_remote_prefill cannot both be true")
    if decode:
        return RemoteDecode()
    if not prefill:
        return None
    try:
        ranks = params["remote_ranks"]
        if not isinstance(ranks, list) or not ranks or not all(isinstance(rank, dict) for rank in ranks):
            raise _invalid("remote_ranks must be a list of objects, one per rank")
        return RemotePrefill(
            request_id=_text(params, "remote_request_id"),
            block_ids=_ints(params, "remote_block_ids"),
            num_tokens=_int(params, "remote_num_tokens"),
            layouts=tuple(_layout(rank) for rank in ranks),
            side_channel=f"{_text(params, 'remote_host')}:{_int(params, 'remote_port')}",
        )
    except KeyError as exc:
        raise _invalid(f"do_remote_prefill needs {exc.args[0]}") from None


def _layout(rank: dict[str, Any]) -> KVLayout:
    layout = KVLayout(session=_text(rank, "session"), k_addrs=_ints(rank, "k_addrs"),
                      v_addrs=_ints(rank, "v_addrs"), block_bytes=_int(rank, "block_bytes"))
    if len(layout.k_addrs) != len(layout.v_addrs) or not layout.k_addrs:
        raise _invalid("each of remote_ranks must name the same layers in k_addrs and v_addrs")
    return layout


def _invalid(why: str) -> InvalidRequestError:
    return InvalidRequestError(f"kv_transfer_params: {why}.", param="kv_transfer_params")


def _text(params: dict[str, Any], key: str) -> str:
    value = params[key]
    if not isinstance(value, str) or not value:
        raise _invalid(f"{key} must be a non-empty string")
    return value


def _int(params: dict[str, Any], key: str) -> int:
    value = params[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _invalid(f"{key} must be a non-negative integer")
    return value


def _ints(params: dict[str, Any], key: str) -> tuple[int, ...]:
    values = params[key]
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise _invalid(f"{key} must be a list of non-negative integers")
    return tuple(values)
