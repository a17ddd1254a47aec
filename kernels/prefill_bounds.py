"""The host-side sizes of one step's prefill chunks, for kernels that cannot find them on the device.

The model runner (server/worker/model_runner.py) knows every chunk's length before the step; a kernel
that picks its path or sizes a launch from them would otherwise read them back from the GPU, a sync per
layer. kernels/cudnn_prefill.py needs them to hand whole prompts to cuDNN's packed-sequence attention.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillBounds:
    max_q_len: int  # the longest chunk
    total_q: int  # the chunks' tokens
    total_context: int  # the contexts' tokens (cached tokens plus each chunk)

    @classmethod
    def from_lens(cls, q_lens: list[int], context_lens: list[int]) -> PrefillBounds:
        return cls(max(q_lens, default=0), sum(q_lens), sum(context_lens))

    @property
    def whole_prompts(self) -> bool:
        """Every chunk is a whole prompt, its context exactly its own tokens: a context holds its chunk,
        so equal totals leave no room for an earlier token anywhere."""
        return self.total_context == self.total_q
