"""A tiny byte-level tokenizer with a ChatML chat template, saved as a model folder (no torch, no hub),
for the router tests and benchmarks/router_overhead.py.

Every byte is one token, so distinct texts give distinct token ids; the special tokens are single ids.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(folder: str | Path, added_tokens: tuple[str, ...] = (),
                         chat_template: str = CHAT_TEMPLATE) -> str:
    """``added_tokens``: more single-id tokens after the specials, shown in decoded text (as Qwen3's
    ``<think>`` and ``</think>`` are)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=chat_template
    )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return str(folder)
