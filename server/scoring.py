"""Scores from embeddings (vLLM's score and rerank for an embedding model): the cosine similarity of
each pair's two vectors. The pairs follow vLLM's rule: one first text against every second text, or the
two lists pairwise. The offline ``LLM.score`` (server/entrypoints/llm.py) and the API's /score and /rerank
(server/api/serving_pooling.py) both pair and score here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from pagedserve.server.exceptions import InvalidRequestError

T = TypeVar("T")


def score_pairs(first: Sequence[T], second: Sequence[T]) -> list[tuple[T, T]]:
    """(first, second) pairs: ``first`` of one item broadcast over ``second``, else equal lengths."""
    if not first or not second:
        raise InvalidRequestError("score needs at least one text on each side", param="text_1")
    if len(first) == 1:
        return [(first[0], item) for item in second]
    if len(first) != len(second):
        raise InvalidRequestError(
            f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1, or as many as text_2",
            param="text_2",
        )
    return list(zip(first, second, strict=True))


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    # Clamped: rounding may take a vector's cosine with itself just past 1
    return max(-1.0, min(1.0, dot / norms)) if norms else 0.0
