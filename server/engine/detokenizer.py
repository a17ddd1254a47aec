"""Incremental detokenization with stop strings.

Each step decodes only a short window of tokens: the text of ``tokens[prefix_offset:]`` minus the text
of ``tokens[prefix_offset:read_offset]`` is what the new tokens added. Decoding from the same start in
both keeps tokenizers that treat a leading space specially honest, and a trailing U+FFFD means a UTF-8
character is split across tokens, so the text waits for the next one.
"""

from __future__ import annotations

from pagedserve.server.request import Request
from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output token, for correct spacing


def init_offsets(request: Request) -> None:
    request.read_offset = request.num_prompt_tokens
    request.prefix_offset = max(request.read_offset - CONTEXT_TOKENS, 0)


def decode_new_text(tokenizer: PreTrainedTokenizerBase, request: Request, upto: int) -> str:
    """Text added by tokens ``[read_offset, upto)`` of the request's tokens; advances the offsets."""
    skip = request.params.skip_special_tokens
    prefix_text = tokenizer.decode(request.token_slice(request.prefix_offset, request.read_offset),
                                   skip_special_tokens=skip)
    full_text = tokenizer.decode(request.token_slice(request.prefix_offset, upto), skip_special_tokens=skip)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    request.prefix_offset = request.read_offset
    request.read_offset = upto
    return full_text[len(prefix_text):]


def find_stop_string(request: Request, new_text_len: int) -> str | None:
    """The first stop string that appears in the text's new tail; cuts ``output_text`` at it."""
    stops = request.params.stop_strings
    if not stops or not new_text_len:
        return None
    text = request.output_text
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
    request.output_text = text[:at + len(stop)] if request.params.include_stop_str_in_output else text[:at]
    return stop
