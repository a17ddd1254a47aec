"""Incremental detokenization with stop strings, one per sequence, run by the front end
(server/engine/output_processor.py), never on the engine's step thread.

Each token decodes only a short window: the text of ``tokens[prefix_offset:]`` minus the text of
``tokens[prefix_offset:read_offset]`` is what the new tokens added. Decoding from the same start in
both keeps tokenizers that treat a leading space specially honest, and a trailing U+FFFD means a UTF-8
character is split across tokens, so the text waits for the next one.

Two vLLM options shape it: stop strings count only once more than ``min_tokens`` tokens are out (as stop
token ids are masked until then), and with ``spaces_between_special_tokens`` off an added token that
follows another is its bare text, without the space some decoders put between them (vLLM's
FastIncrementalDetokenizer rule; it only matters when special tokens are shown).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.server.request import token_slice

CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output token, for correct spacing

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


def text_decoder(tokenizer: Any) -> Decode:
    """The tokenizer's ``decode``, straight to the Rust tokenizer of a fast one where transformers would
    only call it (no clean-up of spaces): the wrapper's argument checks cost more than the decode of a
    few tokens, twice per token per sequence (transformers' tokenization_utils_tokenizers.py _decode)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any  # a transformers PreTrainedTokenizerBase (or anything with its ``decode``)
    prompt_token_ids: list[int]
    skip_special_tokens: bool
    stop_strings: list[str]
    include_stop_str_in_output: bool
    min_tokens: int = 0
    added_tokens: dict[int, str] | None = None  # id -> text; set: no spaces between added tokens
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    decode: Decode | None = None  # text_decoder(tokenizer) unless given (the output processor's, shared)

    def __post_init__(self) -> None:
        if self.decode is None:
            self.decode = text_decoder(self.tokenizer)
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(self.read_offset - CONTEXT_TOKENS, 0)

    def add_token(self, token_id: int, decode: bool = True) -> str | None:
        """Append one token and its text; returns the stop string the text now ends at, if any.

        ``decode`` False keeps the token out of the text (a stop token, unless include_stop_str_in_output).
        """
        self.output_token_ids.append(token_id)
        if not decode:
            return None
        new_text = self._decode_new_text()
        self.text += new_text
        if len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._find_stop_string(len(new_text))

    def _slice(self, start: int, end: int) -> list[int]:
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    def _decode_new_text(self) -> str:
        upto = len(self.prompt_token_ids) + len(self.output_token_ids)
        skip = self.skip_special_tokens
        if not skip and self._follows_added_token(upto):
            self.prefix_offset, self.read_offset = self.read_offset, upto
            return self.added_tokens[self.output_token_ids[-1]]  # type: ignore[index]
        decode = self.decode
        assert decode is not None
        prefix_text = decode(self._slice(self.prefix_offset, self.read_offset), skip)
        full_text = decode(self._slice(self.prefix_offset, upto), skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = upto
        return full_text[len(prefix_text):]

    def _follows_added_token(self, upto: int) -> bool:
        """The newest token and the output token before it are both added tokens, and nothing waits."""
        added, ids = self.added_tokens, self.output_token_ids
        return (
            added is not None
            and len(ids) >= 2
            and ids[-1] in added
            and ids[-2] in added
            and self.read_offset == upto - 1
        )

    def _find_stop_string(self, new_text_len: int) -> str | None:
        """The first stop string that appears in the text's new tail; cuts ``text`` at it."""
        stops = self.stop_strings
        if not stops or not new_text_len:
            return None
        text = self.text
        longest = max(len(s) for s in stops)
        start = max(len(text) - new_text_len - longest + 1, 0)
        best: tuple[int, str] | None = None
        for stop in stops:
            at = text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = text[:at + len(stop)] if self.include_stop_str_in_output else text[:at]
        return stop
