"""How a pooling model turns hidden states into its vector, as its checkpoint says (vLLM's PoolerConfig).

A sentence-transformers checkpoint lists its modules in ``modules.json``: the Transformer, a Pooling
module whose ``config.json`` names the mode (``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``,
``pooling_mode_cls_token``), and a ``Normalize`` module when its vectors are unit length. Without that file
a decoder embedder pools its last token and normalizes, as vLLM does for such models. ``--pooler-config``
(vLLM's JSON: ``{"pooling_type": "MEAN", "normalize": false}``) overrides either. A module this engine
cannot run (a Dense projection, max pooling) is refused at load, naming it, rather than served wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.common.engine_args import json_object
from pagedserve.server.pooling_params import POOLER_CONFIG_KEYS, POOLING_TYPES

_ST = "sentence_transformers.models."
# The Pooling module's mode flags this engine runs, and their pooling type
_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_OTHER_MODES = (
    "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    hidden_size: int
    # Matryoshka models: the ``dimensions`` a request may ask for; () means any up to hidden_size; None:
    # not Matryoshka-trained, so ``dimensions`` is refused (a cut vector of another model means nothing).
    matryoshka_dimensions: tuple[int, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"pooling_type": self.pooling_type, "normalize": self.normalize,
                "matryoshka_dimensions": self.matryoshka_dimensions}  # fmt: skip


def load_pooler_config(model_path: str | Path, hf_config: Any,
                       override: dict[str, Any] | str | None = None) -> PoolerConfig:
    """The model folder's pooler, with ``override`` (``--pooler-config``) applied; ValueError naming what
    cannot be run."""
    pooling_type, normalize = _sentence_transformers_pooler(Path(model_path))
    override = parse_pooler_config(override) or {}
    pooling_type = str(override.get("pooling_type", pooling_type)).upper()
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                         f"{pooling_type!r}")
    hidden_size = int(hf_config.hidden_size)
    return PoolerConfig(pooling_type, bool(override.get("normalize", normalize)), hidden_size,
                        _matryoshka_dimensions(hf_config))


def _sentence_transformers_pooler(path: Path) -> tuple[str, bool]:
    """(pooling type, normalize) from ``modules.json``; (LAST, True) without one."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return "LAST", True
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize = "LAST", False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST)
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling_type = _pooling_mode(json.loads((path / module["path"] / "config.json").read_text()))
        else:
            where = f"{module.get('type')!r} ({module.get('path')!r})"
            raise ValueError(f"the sentence-transformers module {where} is not supported: only Transformer, "
                             "Pooling and Normalize")
    return pooling_type, normalize


def _pooling_mode(config: dict[str, Any]) -> str:
    modes = [kind for key, kind in _POOLING_MODES.items() if config.get(key)]
    others = [key for key in _OTHER_MODES if config.get(key)]
    if others or len(modes) != 1:
        named = ", ".join(others + modes) or "(none)"
        raise ValueError(f"the Pooling module's modes {named} are not supported: exactly one of last-token, "
                         "mean or CLS pooling")
    if config.get("include_prompt") is False:
        raise ValueError("the Pooling module's include_prompt=false is not supported")
    return modes[0]


def _matryoshka_dimensions(hf_config: Any) -> tuple[int, ...] | None:
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    if dimensions:
        return tuple(int(d) for d in dimensions)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def parse_pooler_config(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """``--pooler-config``'s JSON text (or the dict ``LLM(pooler_config=...)`` takes), checked."""
    return json_object("pooler_config", value, POOLER_CONFIG_KEYS)


def resolve_runner(runner: str, model_path: str | Path, hf_config: Any) -> str:
    """``--runner auto`` made "generate" or "pooling" by the checkpoint (vLLM's rule: a base-model
    architecture pools; here a sentence-transformers folder does too); a base model asked to generate is
    refused, for it has no LM head."""
    from pagedserve.server.models.registry import is_base_model

    base = is_base_model(hf_config)
    if runner == "auto":
        return "pooling" if base or (Path(model_path) / "modules.json").is_file() else "generate"
    if runner == "generate" and base:
        raise ValueError(f"{hf_config.architectures[0]} is a base model without an LM head: it runs with "
                         "--runner pooling (embeddings) only")
    return runner
