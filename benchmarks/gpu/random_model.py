"""Random-weight Llama-family model folders for GPU tests and benchmarks, built offline.

A folder holds what ``pagedserve.LLM`` and Hugging Face Transformers both load: ``config.json``,
``generation_config.json``, safetensors weights (sharded above 4 GiB, with an index) and a tokenizer made
with the ``tokenizers`` library (byte-level, no merges: any text encodes to its bytes, every id decodes),
chat template included. No hub access is needed.

    python -m pagedserve.benchmarks.gpu.random_model --shape llama3-8b --num-layers 4 --out /tmp/llama8b-4l

Weights are seeded normal(0, initializer_range), norm weights normal(1, 0.1); speed does not depend on
their values, and engine-vs-HF parity only needs both to load the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

# Llama-family shapes. "smollm2-135m" is the embedded default model's shape.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header|>", "<|end_header|>", "<|eot|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header|>{{ m['role'] }}<|end_header|>"
    "{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header|>assistant<|end_header|>{% endif %}"
)
SHARD_BYTES = 4 << 30


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level tokenizer with exactly ``vocab_size`` ids: specials, the 256 bytes, then fillers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, *byte_chars]:
        vocab[token] = len(vocab)
    assert vocab_size >= len(vocab), f"vocab_size must be >= {len(vocab)}"
    filler = 0
    while len(vocab) < vocab_size:
        vocab[f"w{filler}"] = len(vocab)
        filler += 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[1], model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(shape: str = "smollm2-135m", **overrides: Any) -> Any:
    from transformers import LlamaConfig

    defaults = dict(
        architectures=["LlamaForCausalLM"],
        hidden_act="silu",
        bos_token_id=0,  # SPECIAL_TOKENS order
        eos_token_id=[1, 4],
        pad_token_id=1,
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
    )
    return LlamaConfig(**{**defaults, **SHAPES[shape], **overrides})


def _parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def save_random_model(
    out: str | Path,
    shape: str = "smollm2-135m",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-weight Llama folder to ``out`` (reused as is if already complete) and return it."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out = Path(out)
    if (out / "DONE").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = llama_config(shape, **overrides)
    config.dtype = dtype  # what HF loads by default; the engine takes its own dtype argument
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, size in _parameter_shapes(config).items():
        tensor = torch.randn(size, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * tensor
        else:
            tensor = config.initializer_range * tensor
        tensor = tensor.to(dtype).cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes and shard_bytes + nbytes > SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=0, eos_token_id=[1, 4], pad_token_id=1).save_pretrained(out)
    build_tokenizer(config.vocab_size).save_pretrained(out)
    (out / "DONE").write_text("ok\n")
    return out


def cached_random_model(shape: str, seed: int = 0, **overrides: Any) -> Path:
    """``save_random_model`` under ``$PAGEDSERVE_RANDOM_MODELS`` (default: the temp folder), once."""
    default = Path(tempfile.gettempdir()) / "pagedserve-models"
    root = Path(os.environ.get("PAGEDSERVE_RANDOM_MODELS") or default)
    suffix = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    return save_random_model(root / f"{shape}{suffix}-seed{seed}", shape, seed, **overrides)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    overrides = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    path = save_random_model(args.out, args.shape, args.seed, getattr(torch, args.dtype), **overrides)
    print(path)


if __name__ == "__main__":
    main()
