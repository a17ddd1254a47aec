"""A draft model beside the target in the model runner (speculative_config method "draft_model").

The drafter has its own KV cache tensors for its own layers but the target's block ids, block size and
slot mapping, so the target's single block manager (server/core/kv_cache_manager.py) covers it:

- filling: every forward pass of the target is mirrored by the drafter over the same tokens, positions
  and slots (``mirror``), so its cache holds valid K/V wherever the target's does. A block the prefix
  cache registers was computed by both; a prefix hit is valid for the drafter too.
- rollback: rejected drafts lie past ``num_computed_tokens``, in slots both models rewrite later, as the
  target's own rejected drafts are.
- preemption frees the blocks of both at once; recompute refills both by the mirror.

Drafting (``propose``) happens in the step that verifies the drafts, before the target's forward pass:
the engine core's proposer (server/spec_decode/proposer.py) decided how many (``PENDING`` placeholders),
the scheduler reserved their slots, so the drafter's ``k`` decode passes (from the last known token at
position ``p``, writing positions ``p .. p + k - 1``) only write slots that this step's target pass
rewrites with the same tokens. Greedy requests take the drafter's argmax; sampling requests draw from its
distribution at the request's temperature, and that ``q`` goes to the rejection sampler
(server/spec_decode/rejection_sampler.py), which keeps the target's distribution exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pagedserve.server.core.scheduler import ScheduledRequest
from pagedserve.server.layers.attention import AttentionMetadata, allocate_kv_caches
from pagedserve.server.sample.sampler import exponential_race
from torch import nn

ToDevice = Callable[[torch.Tensor], torch.Tensor]


def check_draft_config(target_config: Any, draft_config: Any) -> None:
    """The drafter proposes token ids the target verifies: both must share one vocabulary."""
    target_vocab, draft_vocab = int(target_config.vocab_size), int(draft_config.vocab_size)
    if target_vocab != draft_vocab:
        raise ValueError(
            f"speculative_config: the draft model's vocab_size ({draft_vocab}) differs from the target's "
            f"({target_vocab}); a draft model must share the target's tokenizer"
        )


class DraftModel:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        allocate_kv_caches(model.attention_layers(), num_blocks, block_size, dtype, device)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The target's step over the drafter's layers: fills its K/V in the same slots."""
        self.model(input_ids, positions, meta)

    def propose(self, items: list[ScheduledRequest], tables: torch.Tensor,
                to_device: ToDevice) -> dict[str, torch.Tensor]:
        """Fill each item's ``len(spec_token_ids)`` drafts (decodes, ``tables`` their padded block tables);
        the draft distributions of the sampling requests, by request id."""
        drafts: list[list[int]] = [[] for _ in items]
        q_rows: list[list[torch.Tensor]] = [[] for _ in items]
        last = [_last_token(item) for item in items]
        for step in range(max(len(item.spec_token_ids) for item in items)):
            active = [i for i, item in enumerate(items) if len(item.spec_token_ids) > step]
            tokens = [drafts[i][-1] if step else last[i] for i in active]
            positions = [items[i].request.num_computed_tokens + step for i in active]
            logits = self._decode(tokens, positions, tables[active], to_device)
            for row, i in enumerate(active):
                token, q = _choose(logits[row], items[i])
                drafts[i].append(token)
                if q is not None:
                    q_rows[i].append(q)
        for item, tokens in zip(items, drafts, strict=True):
            item.spec_token_ids = tokens
        return {item.request.request_id: torch.stack(q) for item, q in zip(items, q_rows, strict=True) if q}

    def _decode(self, tokens: list[int], positions: list[int], tables: torch.Tensor,
                to_device: ToDevice) -> torch.Tensor:
        """One decode pass of the drafter, one token per request; its float32 logits."""
        position_t = torch.tensor(positions, dtype=torch.long)
        rows = torch.arange(len(tokens))
        blocks = tables[rows, position_t // self.block_size].long()
        slots = blocks * self.block_size + position_t % self.block_size
        meta = AttentionMetadata(
            slot_mapping=to_device(slots),
            num_decode_tokens=len(tokens),
            decode_block_tables=to_device(tables),
            decode_context_lens=to_device((position_t + 1).to(torch.int32)),
            prefill_block_tables=to_device(tables[:0]),
            prefill_cu_seqlens_q=to_device(torch.zeros(1, dtype=torch.int32)),
            prefill_context_lens=to_device(torch.zeros(0, dtype=torch.int32)),
        )
        hidden = self.model(to_device(torch.tensor(tokens, dtype=torch.long)), to_device(position_t), meta)
        return self.model.compute_logits(hidden)


def _last_token(item: ScheduledRequest) -> int:
    request = item.request
    (token,) = request.token_slice(request.num_computed_tokens, request.num_computed_tokens + 1)
    return int(token)


def _choose(logits: torch.Tensor, item: ScheduledRequest) -> tuple[int, torch.Tensor | None]:
    """Greedy requests: the drafter's argmax (a point mass). Sampling requests: a draw from the drafter's
    distribution at the request's temperature, drawn from the request's generator when seeded."""
    params = item.request.params
    if params.greedy:
        return int(logits.argmax()), None
    q = torch.softmax(logits.float() / params.temperature, dim=-1)
    token = exponential_race(q.unsqueeze(0), [item.request.generator])
    return int(token), q
