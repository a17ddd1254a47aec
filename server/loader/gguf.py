"""The blocks of a GGUF checkpoint for ``--quantization gguf`` (server/layers/quantization/gguf.py).

The model folder is still the GGUF's conversion (config, tokenizer, the float tensors of norms and of
anything the kernels cannot take: server/loader/default_model.py); ``gguf_blocks`` reads the projections'
Q8_0 / Q4_0 / Q4_1 tensors from the file itself, as raw rows of blocks under their Hugging Face names, and
the loader reads those instead of the folder's dequantized copies. Tensors of other types are left to the
folder (dequantized at conversion) with a log line each.

llama.cpp's converter permutes the rows of q and k (rotary halves interleaved, per head); transformers'
GGUF loader undoes it (``reverse_permute``), and so does ``unpermute_rows`` here, on whole rows of blocks.
Only the llama architecture's names are mapped (SmolLM2, Llama, Mistral GGUFs); other architectures are
refused by name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # what kernels/csrc/gguf_cpu.cpp and kernels/gguf_matmul.py take
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip


def hf_name(name: str, tied: bool) -> str | None:
    """The Hugging Face name of a GGUF projection tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), the tied head's embedding, or None (not a projection)."""
    if name == "output.weight":
        return "lm_head.weight"
    if name == "token_embd.weight":
        return "model.embed_tokens.weight" if tied else None  # untied: only looked up, stays float
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows ``(2, half)`` back to ``(half, 2)`` (transformers'
    ``reverse_permute``), moving whole rows of blocks."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def gguf_blocks(path: str | Path, hf_config: Any) -> dict[str, torch.Tensor]:
    """Raw rows (uint8 ``[N, K / 32 * block bytes]``) of the file's Q8_0 / Q4_0 / Q4_1 projections, keyed
    by Hugging Face name; ``ValueError`` for an architecture other than llama."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if architecture != "llama":
        raise ValueError(f"quantization='gguf' reads llama-architecture GGUF files; {path} is {architecture}")
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    heads = {"q_proj": hf_config.num_attention_heads,
             "k_proj": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads}
    blocks: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, tied)
        if name is None:
            continue
        if tensor.tensor_type.name not in BLOCK_TYPES:
            logger.warning("%s is %s: the gguf kernels take %s, so it is loaded dequantized (float)",
                           tensor.name, tensor.tensor_type.name, "/".join(BLOCK_TYPES))
            continue
        rows = torch.from_numpy(np.array(tensor.data))  # a copy: the reader maps the file read-only
        projection = name.split(".")[-2]
        if projection in heads:
            rows = unpermute_rows(rows, heads[projection])
        blocks[name] = rows
    return blocks
