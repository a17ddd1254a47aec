"""Image parts in the router's prefix key (issue 42): each image stands, where its template puts it, as
a block of ids drawn from its content hash; text-only bodies hash as they always did."""

from __future__ import annotations

import base64
import hashlib

import pytest
from pagedserve.router.hashing import PromptHasher, block_hashes, image_content_hash, image_token_ids

from pagedserve.testing.tiny_tokenizer import build_tiny_tokenizer

BLOCK = 16
SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2-VL's way with parts: text as it is, each image as its vision slot.
VLM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}" + SLOT + "{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "You describe pictures for the blind, carefully and briefly. " * 2
PATH = "/v1/chat/completions"


def png(color: tuple[int, int, int]) -> bytes:
    """Stand-in image bytes: the router hashes them, it never decodes them."""
    return b"\x89PNG\r\n\x1a\n" + bytes(color) * 16


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def body(*urls: str, after: str = "What is it?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user",
             "content": [{"type": "text", "text": "Look:"}, *parts, {"type": "text", "text": after}]},
        ],
    }


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> PromptHasher:
    folder = build_tiny_tokenizer(
        tmp_path_factory.mktemp("vlm_tokenizer"),
        added_tokens=("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
        chat_template=VLM_TEMPLATE,
    )
    return PromptHasher(folder, "tiny-vlm", block_size=BLOCK)


RED, BLUE = data_uri(png((255, 0, 0))), data_uri(png((0, 0, 255)))


def shared_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_an_image_stands_as_a_block_of_its_hash_where_its_template_puts_it(vlm: PromptHasher) -> None:
    ids = vlm.chat_token_ids(body(RED)["messages"])
    engine_text = vlm.render_chat(
        [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                      {"type": "text", "text": "What is it?"}]}]
    )  # what the engine renders (server/api/serving_base.py)
    head, tail = engine_text.split(SLOT)
    before = vlm.tokenizer.encode(head + SLOT, add_special_tokens=False)
    stand_in = image_token_ids(hashlib.sha256(png((255, 0, 0))).digest(), BLOCK)
    assert ids == before + stand_in + vlm.tokenizer.encode(tail, add_special_tokens=False)
    assert len(stand_in) == BLOCK and all(t < 0 for t in stand_in)  # never a real token id


def test_the_same_image_keys_the_same_and_different_images_part_at_the_image(vlm: PromptHasher) -> None:
    red, n_red = vlm.hashes_for(PATH, body(RED))
    assert vlm.hashes_for(PATH, body(RED)) == (red, n_red)
    # The same bytes under another media type are the same image.
    assert vlm.hashes_for(PATH, body(data_uri(png((255, 0, 0)), "image/x-png")))[0] == red
    for after in ("What is it?", ""):  # even with no text after the image, its block is a full one
        a, _ = vlm.hashes_for(PATH, body(RED, after=after))
        b, _ = vlm.hashes_for(PATH, body(BLUE, after=after))
        n = shared_blocks(a, b)
        assert n < len(a) and n < len(b)
        system = vlm.render_chat(body(RED)["messages"][:1], {"add_generation_prompt": False})
        # The system prompt before the image still routes together.
        assert n >= len(vlm.tokenizer.encode(system, add_special_tokens=False)) // BLOCK
    # Two images: their order matters.
    assert vlm.hashes_for(PATH, body(RED, BLUE))[0] != vlm.hashes_for(PATH, body(BLUE, RED))[0]


def test_http_images_key_by_their_url(vlm: PromptHasher) -> None:
    a = vlm.hashes_for(PATH, body("https://example.com/a.png"))[0]
    assert a == vlm.hashes_for(PATH, body("https://example.com/a.png"))[0]
    assert a != vlm.hashes_for(PATH, body("https://example.com/b.png"))[0]
    for url in ("https://example.com/a.png", "data:image/png;base64,%%"):  # the second: not base64
        assert image_content_hash(url) == hashlib.sha256(url.encode()).digest()


def test_text_only_bodies_hash_as_before(vlm: PromptHasher) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    as_parts = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]
    as_text = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    text = vlm.tokenizer.apply_chat_template(as_text, tokenize=False, add_generation_prompt=True)
    expected = vlm.tokenizer.encode(text, add_special_tokens=False)
    assert vlm.chat_token_ids(as_parts) == vlm.chat_token_ids(as_text) == expected
    hashes, n = vlm.hashes_for(PATH, {"messages": as_parts})
    assert hashes == block_hashes(expected, BLOCK, vlm.seed) and n == len(expected)


def test_templates_that_place_no_slot_and_no_tokenizer_still_key_by_image(tiny_tokenizer: str) -> None:
    # The text-only ChatML template prints a message's parts as they are: the images then go last.
    for tokenizer in (tiny_tokenizer, None):
        hasher = PromptHasher(tokenizer, "m", block_size=BLOCK)
        red = hasher.chat_token_ids(body(RED)["messages"])
        blue = hasher.chat_token_ids(body(BLUE)["messages"])
        assert red == hasher.chat_token_ids(body(RED)["messages"])
        assert red[-BLOCK:] == image_token_ids(hashlib.sha256(png((255, 0, 0))).digest(), BLOCK)
        assert red[:-BLOCK] == blue[:-BLOCK] and red != blue
        assert hasher.hashes_for(PATH, body(RED))[0] != hasher.hashes_for(PATH, body(BLUE))[0]
