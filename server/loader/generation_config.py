"""``sampling_defaults``: the sampling values of a generation_config.json, as vLLM's ``--generation-config``.

Model creators put recommended sampling values in generation_config.json; vLLM makes them the defaults
of requests that do not set them (``ModelConfig.get_diff_sampling_param``), and so do we, in one place:
``Processor.sampling_params`` (server/engine/processor.py), which makes the server's requests' parameters
and the offline ``LLM``'s when given none, and resolves an unset max_tokens with the model's.

``generation_config``: ``"auto"`` reads the model folder's file, ``"vllm"`` ignores it (the neutral
defaults of server/sampling_params.py), any other value is a folder whose generation_config.json is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.server.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# The keys vLLM takes from the file; Hugging Face's max_new_tokens is vLLM's max_tokens.
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def sampling_defaults(model_path: Path, generation_config: str = "auto") -> dict[str, Any]:
    """The file's sampling values by SamplingParams name; ``{}`` when there is none.

    Raises ValueError when a value is one SamplingParams refuses: better at start-up than a 400 on every
    request that leaves it unset.
    """
    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else Path(generation_config).expanduser()
    path = folder / FILE_NAME
    if not path.is_file():
        return {}
    values = json.loads(path.read_text())
    defaults = {key: values[key] for key in SAMPLING_KEYS if values.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: sampling values that cannot be defaults: {exc}") from exc
    return defaults
