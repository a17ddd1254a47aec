"""The host-side sizes of one step's prefill chunks, for kernels that cannot find them on the device.

The model runner (server/worker/model_runner.py) knows every chunk's length before the step; a kernel
that sizes a buffer or picks a launch from them would otherwise read them back from the GPU, a sync per
layer. kernels/cudnn_prefill.py needs them to hand whole prompts to cuDNN's packed-sequence attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillBounds:
    cu_seqlens_k: torch.Tensor  # [num_prefills + 1] int32 on the device: each context's offset, packed
    max_q_len: int  # the longest chunk
    max_context_len: int  # the longest context (cached tokens plus its chunk)
    total_q: int  # the chunks' tokens
    total_context: int  # the contexts' tokens: cu_seqlens_k[-1]

    @classmethod
    def from_lens(cls, q_lens: list[int], context_lens: list[int], device: torch.device) -> PrefillBounds:
        offsets = torch.tensor([0, *context_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        if device.type == "cuda":
            offsets = offsets.pin_memory().to(device, non_blocking=True)
        return cls(offsets, max(q_lens, default=0), max(context_lens, default=0), sum(q_lens),
                   sum(context_lens))

    @property
    def whole_prompts(self) -> bool:
        """Every chunk is a whole prompt, its context exactly its own tokens: a context holds its chunk,
        so equal totals leave no room for an earlier token anywhere."""
        return self.total_context == self.total_q
