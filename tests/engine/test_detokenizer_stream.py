"""The two ways a sequence's text grows (server/engine/detokenizer.py): the Rust ``DecodeStream`` of a fast
tokenizer and the decoded windows of any other give the same text, and that text is what the tokenizer's
``decode`` of the whole sequence adds to the prompt's, with special tokens shown or skipped, and with
spaces_between_special_tokens off."""

from __future__ import annotations

import random

import pytest
from pagedserve.server.engine.detokenizer import IncrementalDetokenizer, StreamText, stream_tokenizer

from pagedserve import LLM
from pagedserve.testing.tiny_tokenizer import build_tiny_tokenizer

TEXTS = [
    "Héllo wörld 😀 日本語のテキスト — naïve café ✓",
    "def f(x):\n    return x**2  # ünïcödé 🎉🎉",
    "  leading spaces and\ttabs\n\nnew lines, then ¿qué? and «ceci»",
]


@pytest.fixture(scope="module")
def tokenizers(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> list:
    from transformers import AutoTokenizer

    tiny = AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny")))
    return [llm.get_tokenizer(), tiny]


def sequences(tokenizer, rng: random.Random, count: int) -> list[list[int]]:
    """Token ids of the texts' words, some replaced by special tokens (whole words: a special token
    inside a character's bytes has no one right text)."""
    specials = list(tokenizer.all_special_ids)
    made = []
    for _ in range(count):
        ids: list[int] = []
        for word in rng.choice(TEXTS).split(" "):
            if rng.random() < 0.15:
                ids.append(rng.choice(specials))
            else:
                ids.extend(tokenizer.encode(" " + word, add_special_tokens=False))
        made.append(ids)
    return made


def detokenized(tokenizer, prompt: list[int], output: list[int], stream: bool, **options) -> str:
    backend = stream_tokenizer(tokenizer) if stream else None
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop_strings=[], include_stop_str_in_output=False,
                                         stream_backend=backend, **options)
    if stream:
        assert isinstance(detokenizer.source, StreamText)
    for token_id in output:
        detokenizer.add_token(token_id)
    return detokenizer.text


def test_the_stream_and_the_windows_make_the_same_text(tokenizers) -> None:
    rng = random.Random(0)
    for tokenizer in tokenizers:
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        for ids in sequences(tokenizer, rng, 150):
            cut = rng.randrange(1, len(ids))
            if tokenizer.decode(ids[:cut]).endswith("\ufffd"):
                continue  # the next test's case
            prompt, output = ids[:cut], ids[cut:]
            for skip in (True, False):
                whole = tokenizer.decode(ids, skip_special_tokens=skip)
                expected = whole[len(tokenizer.decode(prompt, skip_special_tokens=skip)):]
                for added_tokens in (None, added):
                    options = {"skip_special_tokens": skip, "added_tokens": added_tokens}
                    text = detokenized(tokenizer, prompt, output, stream=True, **options)
                    assert text == detokenized(tokenizer, prompt, output, stream=False, **options)
                    if added_tokens is None:
                        assert text == expected, (prompt, output)


def test_a_character_split_between_prompt_and_output_is_shown_whole(tokenizers) -> None:
    """The prompt ends inside a character (its last bytes are the first output token's): the stream
    shows that character, as the whole sequence's decode does."""
    tiny = tokenizers[1]  # one token per byte
    ids = tiny.encode("ok ✓ done", add_special_tokens=False)
    cut = len(b"ok ") + 2  # two of the check mark's three bytes
    prompt, output = ids[:cut], ids[cut:]
    assert tiny.decode(prompt).endswith("\ufffd")
    assert detokenized(tiny, prompt, output, stream=True, skip_special_tokens=True) == "✓ done"


def test_the_stream_takes_any_token_id(tokenizers) -> None:
    """An id past the tokenizer's vocabulary (a model's padded one) adds no text and breaks nothing."""
    tokenizer = tokenizers[0]
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    after = tokenizer.encode(" world", add_special_tokens=False)
    text = detokenized(tokenizer, prompt, [len(tokenizer) + 7, *after], stream=True, skip_special_tokens=True)
    assert text == " world"
