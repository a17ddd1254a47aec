"""Counters of speculative decoding, as vLLM's SpecDecodingStats (vllm/v1/spec_decode/metrics.py).

Plain data, no torch: server/api/metrics.py reads a copy per scrape as ``vllm:spec_decode_*``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k, the most drafts a step verifies per request
    num_drafts: int = 0  # verifications: request-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at each position (0 = first) was accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    def snapshot(self) -> SpecDecodingStats:
        return dataclasses.replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
