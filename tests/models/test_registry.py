"""The supported architectures: one registry (server/models/registry.py), named wherever a user looks
(/version is tested in tests/server/test_api_inprocess.py), and checked before any weights are read,
downloaded or converted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from pagedserve.server.loader import resolve_model
from pagedserve.server.models.registry import supported_architectures

from pagedserve import LLM

MODELS_PAGE = Path(__file__).parents[2] / "docs" / "models.md"
UNSUPPORTED = re.compile(
    r"unsupported model architecture \['GPT2LMHeadModel'\]; supported: "
    + re.escape(", ".join(supported_architectures()))
)


def test_every_family_is_registered():
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
        "Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
        "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    }  # fmt: skip


def test_unsupported_folder_fails_before_its_weights(tmp_path):
    """No weight file at all: the error is the architecture's, so nothing tried to read weights first."""
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match=UNSUPPORTED):
        LLM(str(tmp_path), device="cpu", dtype="float32")


def test_unsupported_hub_model_fails_before_the_weights_download(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    downloads: list[list[str]] = []

    def snapshot_download(repo_id, local_files_only=False, allow_patterns=None, **kwargs):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        downloads.append(allow_patterns)
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
        return str(tmp_path)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ValueError, match=UNSUPPORTED):
        resolve_model("someone/tiny-gpt2")
    assert downloads == [["config.json"]]


def test_unsupported_gguf_fails_before_its_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=UNSUPPORTED):
        resolve_model(str(path))
    assert not (tmp_path / "cache").exists()  # the conversion never started


def test_serve_help_names_every_architecture():
    from pagedserve.cli import build_parser

    parser = build_parser()
    serve = next(
        action.choices["serve"]
        for action in parser._actions
        if getattr(action, "choices", None) and "serve" in action.choices
    )
    text = " ".join(serve.format_help().split())
    assert all(name in text for name in supported_architectures()), text[-600:]


def test_the_models_page_lists_every_architecture():
    # Rows of the Models table open with the architectures' names (a family may have two); other tables'
    # rows start otherwise.
    architecture = re.compile(r"`(\w+For(?:CausalLM|ConditionalGeneration))`")
    lines = MODELS_PAGE.read_text().splitlines()
    first_cells = [line.split("|")[1] for line in lines if line.startswith("| `")]
    listed = {name for cell in first_cells for name in architecture.findall(cell)}
    assert listed >= set(supported_architectures())


def test_unreadable_gguf_is_named(tmp_path):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"truncated\.gguf.* is not a GGUF file Transformers can read"):
        resolve_model(str(path))
