"""The embedded default model, model resolution and weight loading."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from pagedserve.server.backend import select_backend
from pagedserve.server.loader import default_model as dm
from pagedserve.server.loader import load_model, resolve, resolve_dtype, resolve_model
from pagedserve.server.loader.weights import iterate_weights
from pagedserve.server.models.registry import build_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# Loading runs no forward pass: the pure-torch backend, which needs no compiled extension, will do.
TORCH = select_backend(torch.device("cpu"), torch.float32, "torch")

# --- the default model ---------------------------------------------------------------------------


def test_default_model_is_cached(default_model_path):
    import pagedserve

    start = time.perf_counter()
    again = pagedserve.default_model()
    assert time.perf_counter() - start < 0.5
    assert again == default_model_path
    folder = Path(default_model_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names  # tied: the head is the embedding


def test_hf_transformers_loads_default_model_and_answers_paris(default_model_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


def _fake_convert(calls: list[Path], delay: float = 0.2):
    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        (out_dir / "config.json").write_text("{}")
        time.sleep(delay)  # a window in which a half-built folder could be seen
        (out_dir / "model.safetensors").write_bytes(b"x")

    return convert


def test_concurrent_conversions_build_once_and_atomically(tmp_path, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(dm, "convert_gguf", _fake_convert(calls))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "models" / "m"
    results, seen_partial = [], []

    def worker() -> None:
        results.append(dm.ensure_converted(gguf, target))

    def watcher() -> None:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if target.exists() and not (target / "model.safetensors").exists():
                seen_partial.append(True)

    threads = [threading.Thread(target=worker) for _ in range(4)] + [threading.Thread(target=watcher)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [target] * 4
    assert not seen_partial
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]  # no temp folders left
    # A folder without the completion marker is rebuilt.
    (target / dm.MARKER).unlink()
    assert dm.ensure_converted(gguf, target) == target
    assert len(calls) == 2 and (target / dm.MARKER).is_file()


def test_cache_root_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "explicit"))
    assert dm.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("PAGEDSERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_root() == tmp_path / "xdg" / "pagedserve"


# --- resolve_model -------------------------------------------------------------------------------


def test_resolve_model(default_model_path, tmp_path, monkeypatch):
    assert resolve_model(None) == Path(default_model_path)
    assert resolve_model(str(tmp_path)) == tmp_path
    # A .gguf file is converted once into the cache, like the default model.
    calls: list[Path] = []
    monkeypatch.setattr(dm, "convert_gguf", _fake_convert(calls, delay=0))
    # Its metadata's architecture is read before converting (tests/models/test_registry.py); faked as well.
    monkeypatch.setattr(resolve, "gguf_architectures", lambda path: ["LlamaForCausalLM"])
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    converted = resolve_model(str(gguf))
    assert converted.parent == tmp_path / "cache" / "models" / "gguf"
    assert converted.name.startswith("tiny-") and (converted / dm.MARKER).is_file()
    assert resolve_model(str(gguf)) == converted and len(calls) == 1


def test_resolve_model_errors_name_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model-4242"):
        resolve_model("no-such-org/no-such-model-4242")
    missing = str(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="absent"):
        resolve_model(missing)
    with pytest.raises(ValueError, match="bad name!!"):
        resolve_model("bad name!!")
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hi")
    with pytest.raises(ValueError, match=r"notes\.txt"):
        resolve_model(str(not_a_model))


# --- load_model ----------------------------------------------------------------------------------

TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _tiny_hf(tie: bool):
    torch.manual_seed(0)
    config = LlamaConfig(**TINY, tie_word_embeddings=tie)
    config.architectures = ["LlamaForCausalLM"]
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _assert_same_weights(ours, hf) -> None:
    state = hf.state_dict()
    layer = ours.model.layers[1]
    attn = hf.model.layers[1].self_attn
    expected_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, expected_qkv, rtol=0, atol=0)
    mlp = hf.model.layers[1].mlp
    expected_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, expected_gate_up, rtol=0, atol=0)
    torch.testing.assert_close(ours.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    head = ours.model.embed_tokens.weight if ours.lm_head is None else ours.lm_head.weight
    torch.testing.assert_close(head, state["lm_head.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_load_sharded_checkpoint(tmp_path, tie):
    hf = _tiny_hf(tie)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours, config = load_model(tmp_path, "float32", "cpu", backend=TORCH)
    assert config.tie_word_embeddings == tie and (ours.lm_head is None) == tie
    assert not ours.training
    _assert_same_weights(ours, hf)


def test_load_weights_without_model_prefix_and_missing_weights(tmp_path):
    hf = _tiny_hf(tie=False)
    ours = build_model(hf.config, torch.float32, "cpu", TORCH)
    state = hf.state_dict()
    ours.load_weights((name.removeprefix("model."), tensor) for name, tensor in state.items())
    _assert_same_weights(ours, hf)
    incomplete = {k: v for k, v in state.items() if "layers.1.self_attn.v_proj" not in k}
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.v_proj\.weight"):
        build_model(hf.config, torch.float32, "cpu", TORCH).load_weights(incomplete.items())
    with pytest.raises(ValueError, match="no_such_tensor"):
        build_model(hf.config, torch.float32, "cpu", TORCH).load_weights(
            [("model.no_such_tensor", torch.zeros(1))]
        )
    wrong = dict(state, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"norm\.weight"):
        build_model(hf.config, torch.float32, "cpu", TORCH).load_weights(wrong.items())


def test_iterate_and_dummy_weights(tmp_path):
    hf = _tiny_hf(tie=True)
    hf.save_pretrained(tmp_path)
    assert {name for name, _ in iterate_weights(tmp_path)} == set(hf.state_dict()) - {"lm_head.weight"}
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"safetensors"):
        load_model(tmp_path, "float32", "cpu", backend=TORCH)
    dummy, _ = load_model(tmp_path, "bfloat16", "cpu", backend=TORCH, load_format="dummy")
    weight = dummy.model.layers[0].self_attn.qkv_proj.weight
    assert weight.dtype == torch.bfloat16 and torch.isfinite(weight).all() and weight.std() > 0
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path / "nowhere", "float32", "cpu", backend=TORCH)


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int3", "cpu")
