"""What names an adapter: vLLM's ``LoRARequest`` and ``--lora-modules`` entries. No torch here: the
API layer and EngineConfig import these."""

from __future__ import annotations

import json
from dataclasses import dataclass


class LoRALoadError(ValueError):
    """An adapter that cannot be served: not a PEFT LoRA folder, a rank above max_lora_rank, target
    modules the model lacks, a feature not supported. The server answers it with a 400 and the reason."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's offline handle of an adapter: a name (the API's ``model``), an id unique among the loaded
    adapters (> 0), and a PEFT folder or a Hugging Face id."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, value: str | dict | LoRAModulePath) -> LoRAModulePath:
        if isinstance(value, LoRAModulePath):
            return value
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"lora module {value!r} is not valid JSON: {exc}") from exc
        if isinstance(value, dict):
            unknown = set(value) - {"name", "path", "base_model_name"}
            if unknown or not value.get("name") or not value.get("path"):
                raise ValueError(
                    'a lora module in JSON is {"name": ..., "path": ..., "base_model_name": ...}, '
                    f"got {value!r}"
                )
            return cls(str(value["name"]), str(value["path"]), value.get("base_model_name"))
        name, sep, path = str(value).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"a lora module is name=path or JSON, got {value!r}")
        return cls(name, path)
