"""The step's token bitmask: one row of bits per sampled request that has a grammar (bit set = allowed).

server/worker/model_runner.py fills it right after launching the forward pass: on a GPU the pass runs
asynchronously, so the matchers' work on the CPU overlaps it; on the CPU backend the pass is synchronous
and the fill simply follows it. server/sample/sampler.py applies it before anything else (vLLM V1 applies
its grammar bitmask to the logits before the sampler), so logprobs, penalties and sampling all see the
masked logits. Rows without a grammar are neither filled nor touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pagedserve.server.grammar_state import GrammarState, Phase

if TYPE_CHECKING:
    from pagedserve.server.request import Request

BITS = 32


@dataclass
class GrammarBitmask:
    rows: list[int]  # the batch rows that have a grammar, ascending
    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, bit t % 32 of word t // 32 allows token t

    def select(self, row: int) -> GrammarBitmask | None:
        """This one batch row's mask, as row 0 (the sampler samples a failing batch row by row)."""
        if row not in self.rows:
            return None
        position = self.rows.index(row)
        return GrammarBitmask([0], self.bits[position:position + 1])


def fill_grammar_bitmask(requests: list[Request]) -> GrammarBitmask | None:
    """The masks of the requests that have a grammar, row by row on this thread.

    Not llguidance's parallel ``LLExecutor``: a row costs tens of microseconds (64 rows ~0.4 ms serially,
    ~0.25 ms in its pool, on this repository's CPU), and a pool's threads, still spinning when the next
    forward pass starts, take cores from torch's own threads on the CPU backend.
    """
    rows = [row for row, request in enumerate(requests) if request.grammar is not None]
    if not rows:
        return None
    words = (requests[rows[0]].grammar.vocab_size + BITS - 1) // BITS  # type: ignore[union-attr]
    bits = torch.empty((len(rows), words), dtype=torch.int32)
    for index, row in enumerate(rows):
        fill_row(requests[row].grammar, bits, index)  # type: ignore[arg-type]
    return GrammarBitmask(rows, bits)


def fill_row(grammar: GrammarState, bits: torch.Tensor, index: int) -> None:
    """Row ``index`` of ``bits``: the tokens ``grammar`` allows next. A reasoning model's reasoning is
    free; its first token may also be the opening tag (server/grammar_state.py ``Phase``)."""
    if grammar.waiting:
        bits[index] = -1
        return
    words = bits.shape[1]
    grammar.matcher.unsafe_compute_mask_ptr(bits.data_ptr() + index * words * 4, words * 4)  # drops the GIL
    if grammar.phase is Phase.DECIDING:
        start = grammar.gate.start_token_id  # type: ignore[union-attr]
        bits[index, start // BITS] |= _bit(start % BITS)


def _bit(position: int) -> int:
    """Bit ``position`` of an int32 word, as the signed value torch stores (bit 31 is negative)."""
    return -(1 << 31) if position == 31 else 1 << position


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask | None) -> torch.Tensor:
    """``logits`` with every token a row's grammar refuses at -inf; ``mask.bits`` on ``logits.device``."""
    if mask is None:
        return logits
    device, vocab = logits.device, logits.shape[1]
    bits = mask.bits
    if bits.shape[1] * BITS < vocab:  # logits wider than the tokenizer: the extra ids are never text
        bits = torch.nn.functional.pad(bits, (0, (vocab + BITS - 1) // BITS - bits.shape[1]), value=0)
    shifts = torch.arange(BITS, dtype=torch.int32, device=device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if len(mask.rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(mask.rows, dtype=torch.long, device=device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)
