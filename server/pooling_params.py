"""Per-request parameters of a pooling request (vLLM's ``PoolingParams``): the engine runs the prompt
and returns one vector made from its hidden states instead of sampling tokens.

How the vector is made is the model's (its sentence-transformers files, server/loader/pooler_config.py);
the front end's processor (server/engine/processor.py) resolves those into every request's params, so
the runner (server/worker/pooler.py) reads them from the request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.server.exceptions import InvalidRequestError

# vLLM's pooling types that exist here: the last prompt token's hidden state (decoder embedders such as
# Qwen3-Embedding and e5-mistral), the mean over every prompt token, the first token's (BERT's [CLS]).
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# What --pooler-config may set over the checkpoint's choice (server/loader/pooler_config.py)
POOLER_CONFIG_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None  # keep the first ``dimensions`` values (Matryoshka models), then normalize
    normalize: bool | None = None  # None: as the model says
    pooling_type: str | None = None  # None: as the model says

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}",
                                      param="dimensions")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}",
                param="pooling_type",
            )

    @property
    def reads_every_position(self) -> bool:
        """The vector needs every prompt position's hidden state, so no prefix-cache hit can stand in for
        one (server/core/kv_cache_manager.py); LAST reads only the final position, which always runs."""
        return self.pooling_type != "LAST"
