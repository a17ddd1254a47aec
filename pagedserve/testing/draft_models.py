"""Draft models for speculative decoding tests and benchmarks, cut from a real checkpoint.

``truncated_draft(source, folder, num_layers)`` writes a checkpoint with the source's config, tokenizer
and weights but only its first ``num_layers`` decoder layers (embeddings, final norm and head kept): a
smaller model of the same vocabulary whose proposals the source accepts in part.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def truncated_draft(source: str | Path, folder: str | Path, num_layers: int) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, folder = Path(source), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{config['num_hidden_layers']}, got {num_layers}")
    config["num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json" and item.is_file() \
                and not item.name.endswith(".index.json"):
            shutil.copy(item, folder / item.name)
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                match = _LAYER.search(name)
                if match is None or int(match.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
