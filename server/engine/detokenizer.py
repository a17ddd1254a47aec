"""Incremental detokenization with stop strings, one per sequence, run by the front end
(server/engine/output_processor.py), never on the engine's step thread.

Two ways to turn the next token into text, the same text for any text a tokenizer could have made:

- ``StreamText`` (a fast tokenizer, as vLLM's FastIncrementalDetokenizer): the Rust tokenizer's own
  ``DecodeStream``, one call per token, which holds back the bytes of a split UTF-8 character itself. It
  is primed with the prompt's last tokens from one that starts a character, for the right spacing.
- ``WindowText`` (any other tokenizer): each token decodes only a short window: the text of
  ``tokens[prefix_offset:]`` minus the text of ``tokens[prefix_offset:read_offset]`` is what the new tokens
  added. Decoding from the same start in both keeps tokenizers that treat a leading space specially honest,
  and a trailing U+FFFD means a UTF-8 character is split across tokens, so the text waits for the next one.

Two vLLM options shape it: stop strings count only once more than ``min_tokens`` tokens are out (as stop
token ids are masked until then), and with ``spaces_between_special_tokens`` off an added token that
follows another is its bare text, without the space some decoders put between them (vLLM's
FastIncrementalDetokenizer rule; it only matters when special tokens are shown).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedserve.server.request import token_slice

logger = logging.getLogger("pagedserve.engine")

CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output token, for correct spacing
MAX_CONTEXT_TOKENS = 24  # the most a stream is primed with when the last 5 start inside a character

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


def text_decoder(tokenizer: Any) -> Decode:
    """The tokenizer's ``decode``, straight to the Rust tokenizer of a fast one where transformers would
    only call it (no clean-up of spaces): the wrapper's argument checks cost more than the decode of a
    few tokens, twice per token per sequence (transformers' tokenization_utils_tokenizers.py _decode)."""
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` under a fast tokenizer whose ``decode`` is that tokenizer's alone (no
    clean-up of spaces after it), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def stream_tokenizer(tokenizer: Any) -> Any | None:
    """The Rust tokenizer ``StreamText`` drives, None where it cannot (a slow tokenizer, clean-up of
    spaces, or a tokenizers release without ``DecodeStream``)."""
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return None
    return rust_tokenizer(tokenizer)


class TextSource(Protocol):
    def next_text(self, output_token_ids: list[int]) -> str:
        """The text the newest of ``output_token_ids`` adds ("" while a character is incomplete)."""
        ...

    def nothing_waits(self, output_token_ids: list[int]) -> bool:
        """Every token before the newest is in the text already (no split character waits)."""
        ...

    def pass_over(self, output_token_ids: list[int]) -> None:
        """The newest token is in the text (as its bare added-token text): go on after it."""
        ...


@dataclass
class WindowText:
    decode: Decode
    prompt_token_ids: list[int]
    skip_special_tokens: bool
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(self.read_offset - CONTEXT_TOKENS, 0)

    def next_text(self, output_token_ids: list[int]) -> str:
        upto = len(self.prompt_token_ids) + len(output_token_ids)
        skip, decode = self.skip_special_tokens, self.decode
        prefix_text = decode(self._slice(output_token_ids, self.prefix_offset, self.read_offset), skip)
        full_text = decode(self._slice(output_token_ids, self.prefix_offset, upto), skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = upto
        return full_text[len(prefix_text):]

    def nothing_waits(self, output_token_ids: list[int]) -> bool:
        """Every token before the newest is in the text already (no split character waits)."""
        return self.read_offset == len(self.prompt_token_ids) + len(output_token_ids) - 1

    def pass_over(self, output_token_ids: list[int]) -> None:
        """The newest token is in the text (as its bare added-token text): start the next window there."""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.prompt_token_ids) + len(output_token_ids)

    def _slice(self, output_token_ids: list[int], start: int, end: int) -> list[int]:
        return token_slice(self.prompt_token_ids, output_token_ids, start, end)


class StreamText:
    def __init__(self, backend: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.pending = False  # the last step gave no text: a character waits for its other bytes
        self.stream = self._new_stream()
        for token_id in prompt_token_ids[self._context_start(prompt_token_ids):]:
            self._step(token_id)

    def _new_stream(self) -> Any:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _context_start(self, prompt_token_ids: list[int]) -> int:
        """Where the prompt's context starts: the last ``CONTEXT_TOKENS``, or more where those start inside
        a character (their text would begin with U+FFFD, which the stream would then emit)."""
        n = len(prompt_token_ids)
        for size in range(min(CONTEXT_TOKENS, n), min(MAX_CONTEXT_TOKENS, n) + 1):
            text = self.backend.decode(prompt_token_ids[n - size:], skip_special_tokens=False)
            if not text.startswith("\ufffd"):
                return n - size
        return max(n - MAX_CONTEXT_TOKENS, 0)

    def next_text(self, output_token_ids: list[int]) -> str:
        text = self._step(output_token_ids[-1])
        self.pending = text is None
        return text or ""

    def nothing_waits(self, output_token_ids: list[int]) -> bool:
        return not self.pending

    def pass_over(self, output_token_ids: list[int]) -> None:
        """The newest token is in the text (as its bare added-token text): the stream steps over it."""
        self.next_text(output_token_ids)

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.backend, token_id)
        except (TypeError, OverflowError):
            return None  # not a token id the tokenizer can take: no text, as its decode gives
        except Exception:
            # The stream's state broke (a tokenizer whose text of a longer sequence does not extend the
            # shorter one's, tokenizers' "Invalid prefix encountered"): go on from this token, unprimed.
            logger.debug("restarting a detokenizer stream at token %d", token_id, exc_info=True)
            self.stream = self._new_stream()
            return self.stream.step(self.backend, token_id)


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
    decode: Decode | None = None  # text_decoder(tokenizer) unless given (the output processor's, shared)
    # stream_tokenizer(tokenizer) to use StreamText (the output processor's); None: WindowText
    stream_backend: Any | None = None
    source: TextSource = field(init=False)

    def __post_init__(self) -> None:
        if self.stream_backend is not None:
            self.source = StreamText(self.stream_backend, self.prompt_token_ids, self.skip_special_tokens)
            return
        if self.decode is None:
            self.decode = text_decoder(self.tokenizer)
        self.source = WindowText(self.decode, self.prompt_token_ids, self.skip_special_tokens)

    def add_token(self, token_id: int, decode: bool = True) -> str | None:
        """Append one token and its text; returns the stop string the text now ends at, if any.

        ``decode`` False keeps the token out of the text (a stop token, unless include_stop_str_in_output).
        """
        self.output_token_ids.append(token_id)
        if not decode:
            return None
        new_text = self._new_text()
        self.text += new_text
        if len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._find_stop_string(len(new_text))

    def _new_text(self) -> str:
        ids, source = self.output_token_ids, self.source
        if self.skip_special_tokens or not self._follows_added_token() or not source.nothing_waits(ids):
            return source.next_text(ids)
        source.pass_over(ids)
        return self.added_tokens[ids[-1]]  # type: ignore[index]

    def _follows_added_token(self) -> bool:
        """The newest token and the output token before it are both added tokens."""
        added, ids = self.added_tokens, self.output_token_ids
        return added is not None and len(ids) >= 2 and ids[-1] in added and ids[-2] in added

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
