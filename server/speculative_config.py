"""``speculative_config``: vLLM's dict, parsed and checked once into ``SpeculativeConfig``.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": M, "prompt_lookup_min": m}``
proposes by prompt lookup (server/spec_decode/ngram.py). ``{"model": path, "num_speculative_tokens": k}``
(method "draft_model") proposes with a smaller model of the same vocabulary, run by the model runner
beside the target (server/spec_decode/draft_model.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
# Past this many running requests a CPU forward is compute-bound: verifying 4 drafts per request cost 1.7x
# a plain decode step at batch 1-4, 2.3x at 8 and 3.2x at 16 on the embedded model (2 cores, one torch
# thread; benchmarks/README.md "Speculative decoding"), more than typical drafts save there.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    # vLLM's name: no drafts while more than this many requests run (the forward is compute-bound there).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict (or its JSON text, as ``--speculative-config`` gives it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        args = dict(value)
        if "method" not in args:
            args["method"] = "draft_model" if args.get("model") else "ngram"
        return cls(**args)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer >= 1, "
                f"got {self.num_speculative_tokens!r}"
            )
        if self.disable_by_batch_size < 1:
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs 'model'")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative_config: prompt_lookup_* apply to method 'ngram' only")
            return
        if self.model:
            raise ValueError("speculative_config: 'model' applies to method 'draft_model' only")
        self._check_lookup()

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def _check_lookup(self) -> None:
        # vLLM's defaults: neither given means 5..5, one given stands for both.
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        if self.prompt_lookup_min < 1:
            raise ValueError(
                f"speculative_config.prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
