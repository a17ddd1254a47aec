"""Prompt-lookup drafting (vLLM's NgramProposer): the last ``n`` tokens of a sequence, ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``, are looked up earlier in the same sequence, and the
tokens that followed an earlier occurrence are proposed. Text that copies its input (rewrites,
extraction, code edits) is drafted well; other text mostly finds no match, which costs nothing.

Cost: one vectorised comparison over the sequence per ``n`` tried, bounded by ``max_model_len``.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest matching suffix: the latest
    with ``k`` tokens after it, else the earliest."""
    length = token_ids.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        # Candidate starts i < length - n (the suffix itself excluded) whose first token matches.
        starts = np.flatnonzero(token_ids[: length - n] == suffix[0])
        for i in range(1, n):
            if starts.size == 0:
                break
            starts = starts[token_ids[starts + i] == suffix[i]]
        if starts.size:
            # The latest match with k tokens after it (in a repeating text the latest is cut short by the end)
            full = starts[starts + n + k <= length]
            follow = int(full[-1] if full.size else starts[0]) + n
            return token_ids[follow:follow + k].tolist()
    return []
