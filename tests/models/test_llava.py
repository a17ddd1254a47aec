"""LLaVA through the engine (issue 42): a tiny random LLaVA (CLIP tower, projector, Llama or Mistral
decoder) made with Transformers' own config classes and processor; greedy tokens equal HF's ``generate``
on the same inputs: one image, two images in a prompt, batched with text-only prompts, with chunked
prefill splitting an image's placeholder run, on prefix-cache hits of a repeated image; a different image
after the same text gets no false hit; the requests' checks; nothing left behind."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pagedserve.server.exceptions import InvalidRequestError
from PIL import Image

from pagedserve import LLM, SamplingParams
from pagedserve.testing.leaks import assert_no_leak
from pagedserve.testing.tiny_models import TINY_ENGINE, tiny_llava_checkpoint
from pagedserve.testing.vlm import assert_greedy_batch

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module", params=[("llama", "clip"), ("mistral", "clip"), ("llama", "siglip")],
                ids=["clip-llama", "clip-mistral", "siglip-llama"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    decoder, tower = request.param
    folder = tmp_path_factory.mktemp(f"llava-{tower}-{decoder}")
    return folder, tiny_llava_checkpoint(folder, decoder, tower=tower)


def hf_greedy(checkpoint: tuple[Path, Any], text: str, images: list[Image.Image]) -> list[int]:
    from transformers import AutoProcessor

    folder, hf = checkpoint
    batch = AutoProcessor.from_pretrained(str(folder))(text=text, images=images or None, return_tensors="pt")
    generated = hf.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return generated[0, batch["input_ids"].shape[1] :].tolist()


def request(text: str, images: list[Image.Image]) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


CASES = [
    (prompt("look <image> at this"), [image(0)]),
    (prompt("two: <image> and <image>, which?"), [image(1), image(2, (20, 50))]),
    (prompt("only text here, no picture at all"), []),
    (prompt("<image>"), [image(3)]),
]


@pytest.mark.parametrize("engine_args", [
    pytest.param({}, id="whole-prompts"),
    pytest.param({"max_num_batched_tokens": 6, "block_size": 8}, id="chunks-of-6"),
])  # fmt: skip
def test_greedy_tokens_equal_hf(checkpoint: tuple[Path, Any], engine_args: dict[str, Any]) -> None:
    expected = [hf_greedy(checkpoint, text, images) for text, images in CASES]
    llm = LLM(str(checkpoint[0]), **TINY_ENGINE, **engine_args)
    assert_greedy_batch(llm, [request(text, images) for text, images in CASES], expected, GREEDY)
    assert_no_leak(llm.engine)


def test_prefix_cache_hits_only_the_same_image(checkpoint: tuple[Path, Any]) -> None:
    text = prompt("a long enough question before the picture: <image> what is it?")
    llm = LLM(str(checkpoint[0]), **TINY_ENGINE, block_size=8)
    (first,) = llm.generate(request(text, [image(4)]), GREEDY)
    assert first.num_cached_tokens == 0
    (again,) = llm.generate(request(text, [image(4)]), GREEDY)
    assert again.num_cached_tokens >= 40  # blocks through and past the image
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(checkpoint, text, [image(4)])
    (other,) = llm.generate(request(text, [image(5)]), GREEDY)
    image_offset = len(llm.get_tokenizer().encode(text.split("<image>")[0]))
    assert other.num_cached_tokens == image_offset // 8 * 8  # only the text blocks before the image
    assert other.outputs[0].token_ids == hf_greedy(checkpoint, text, [image(5)])
    assert_no_leak(llm.engine)


def test_image_requests_are_checked(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    llm = LLM(str(checkpoint[0]), **TINY_ENGINE, limit_mm_per_prompt='{"image": 1}')
    with pytest.raises(InvalidRequestError, match="At most 1 images"):
        llm.generate(request(prompt("<image> <image>"), [image(0), image(1)]), GREEDY)
    with pytest.raises(InvalidRequestError, match=r"could not be processed.*2 <image> tokens and 1 images"):
        llm.generate(request(prompt("<image> <image>"), [image(0)]), GREEDY)
    with pytest.raises(InvalidRequestError, match="takes image"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": [b""]}}, GREEDY)
    assert_no_leak(llm.engine)


def test_a_text_model_refuses_images(tmp_path: Path) -> None:
    from pagedserve.testing.tiny_models import tiny_embedding_checkpoint

    llm = LLM(str(tiny_embedding_checkpoint(tmp_path)), runner="generate", **TINY_ENGINE)
    with pytest.raises(InvalidRequestError, match="text only"):
        llm.generate(request("look <image>", [image(0)]), GREEDY)


async def test_the_openai_client_sends_an_image_through_the_server(checkpoint: tuple[Path, Any]) -> None:
    """A data-URI image part through the server, in-process over a real engine: the answer is HF's greedy
    reply to the same rendered prompt and image; the KV blocks and the encoder cache empty after."""
    from pagedserve.testing.vlm import chat_with_image, in_process_server, png_data_uri

    llm = LLM(str(checkpoint[0]), **TINY_ENGINE)
    async with in_process_server(llm) as http:
        reply = await chat_with_image(http, "what is ", image(6), " here?", NEW_TOKENS)
    # The same request offline gives HF's tokens, and its text is what the server answered (a random
    # model's bytes decode to partial characters, so tokens are compared where they can be).
    text, decoded = prompt("what is <image> here?"), png_data_uri(image(6))[1]
    (offline,) = llm.generate(request(text, [decoded]), GREEDY)
    assert offline.outputs[0].token_ids == hf_greedy(checkpoint, text, [decoded])
    assert reply.choices[0].message.content == offline.outputs[0].text
    assert reply.usage.prompt_tokens == len(llm.get_tokenizer().encode(text)) + 3  # 1 placeholder, 4 tokens
    gc.collect()
    assert len(llm.engine.core.executor.runner.encoder_cache) == 0
    assert_no_leak(llm.engine)


async def test_a_completion_prompt_takes_images_by_url(checkpoint: tuple[Path, Any]) -> None:
    """/v1/completions with ``multi_modal_data`` (the offline LLM's, images by URL): the offline request's
    tokens and text; a batch of prompts or token ids with images is a 400 naming the prompt."""
    from pagedserve.testing.vlm import GREEDY_FIELDS, in_process_server, png_data_uri

    llm = LLM(str(checkpoint[0]), **TINY_ENGINE)
    text = prompt("first <image> then <image>?")
    (url_a, image_a), (url_b, image_b) = png_data_uri(image(7)), png_data_uri(image(8, (50, 20)))
    body = {"prompt": text, "max_tokens": NEW_TOKENS, "multi_modal_data": {"image": [url_a, url_b]},
            **GREEDY_FIELDS}  # fmt: skip
    async with in_process_server(llm) as http:
        response = await http.post("/v1/completions", json=body)
        batch = await http.post("/v1/completions", json={**body, "prompt": [text, text]})
    assert response.status_code == 200, response.text
    (offline,) = llm.generate(request(text, [image_a, image_b]), GREEDY)
    assert offline.outputs[0].token_ids == hf_greedy(checkpoint, text, [image_a, image_b])
    assert response.json()["choices"][0]["text"] == offline.outputs[0].text
    assert response.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "prompt"
    assert_no_leak(llm.engine)
