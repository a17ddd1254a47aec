"""Qwen2-VL and Qwen2.5-VL through the engine (issue 42): tiny random models made with Transformers' own
config classes, their vision transformer (Qwen2.5's with window attention) before our Qwen2 decoder with
multimodal RoPE. Greedy tokens equal HF's ``generate`` on the same inputs: images of other grids than
square (so height and width positions differ), two images in a prompt, batched with text-only prompts,
with chunked prefill splitting an image's run, on prefix-cache hits; a different image gets no false hit.

Here Transformers' Qwen2-VL processor cannot be built (its video processor needs torchvision), so both
sides take their inputs from the checkpoint's image processor and tokenizer (server/multimodal.py
``GridImageProcessor``); HF's model computes its own 3-D positions from them (``get_rope_index``)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from pagedserve import LLM, SamplingParams
from pagedserve.testing.leaks import assert_no_leak
from pagedserve.testing.tiny_models import QWEN2_VL_TOKENS, TINY_ENGINE, TINY_VOCAB, tiny_qwen2_vl_checkpoint
from pagedserve.testing.vlm import assert_greedy_batch

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = TINY_VOCAB + QWEN2_VL_TOKENS.index("<|image_pad|>")


def prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2-vl", "qwen2.5-vl"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp(f"qwen{request.param}-vl")
    return folder, tiny_qwen2_vl_checkpoint(folder, version=request.param)


def hf_greedy(checkpoint: tuple[Path, Any], text: str, images: list[Image.Image]) -> list[int]:
    from pagedserve.server.engine.processor import _hf_processor

    folder, hf = checkpoint
    if images:
        batch = _hf_processor(folder, IMAGE_PAD, 2)(text=text, images=images)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        batch = {"input_ids": tokenizer(text, return_tensors="pt")["input_ids"]}
    ids = batch["input_ids"]
    inputs = {**batch, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE_PAD).int()}
    generated = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return generated[0, ids.shape[1] :].tolist()


def request(text: str, images: list[Image.Image]) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


CASES = [
    (prompt(f"look {IMAGE} at this"), [image(0, 90, 60)]),  # a 2 x 3 merged grid
    (prompt(f"two: {IMAGE} and {IMAGE}, which?"), [image(1, 40, 100), image(2, 56, 56)]),
    (prompt("only text here, no picture at all"), []),
]


@pytest.mark.parametrize("engine_args", [
    pytest.param({}, id="whole-prompts"),
    pytest.param({"max_num_batched_tokens": 5, "block_size": 8}, id="chunks-of-5"),
])  # fmt: skip
def test_greedy_tokens_equal_hf(checkpoint: tuple[Path, Any], engine_args: dict[str, Any]) -> None:
    expected = [hf_greedy(checkpoint, text, images) for text, images in CASES]
    llm = LLM(str(checkpoint[0]), **TINY_ENGINE, **engine_args)
    assert_greedy_batch(llm, [request(text, images) for text, images in CASES], expected, GREEDY)
    assert_no_leak(llm.engine)


def test_prefix_cache_hits_only_the_same_image(checkpoint: tuple[Path, Any]) -> None:
    text = prompt(f"a question long enough to fill a block: {IMAGE} what is it?")
    llm = LLM(str(checkpoint[0]), **TINY_ENGINE, block_size=8)
    (first,) = llm.generate(request(text, [image(4, 60, 60)]), GREEDY)
    (again,) = llm.generate(request(text, [image(4, 60, 60)]), GREEDY)
    assert again.num_cached_tokens > first.num_cached_tokens == 0
    expected = hf_greedy(checkpoint, text, [image(4, 60, 60)])
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == expected
    (other,) = llm.generate(request(text, [image(5, 60, 60)]), GREEDY)
    assert other.num_cached_tokens < again.num_cached_tokens
    assert other.outputs[0].token_ids == hf_greedy(checkpoint, text, [image(5, 60, 60)])
    assert_no_leak(llm.engine)


async def test_the_openai_client_sends_an_image_through_the_server(checkpoint: tuple[Path, Any]) -> None:
    from pagedserve.testing.vlm import chat_with_image, in_process_server, png_data_uri

    llm = LLM(str(checkpoint[0]), **TINY_ENGINE)
    async with in_process_server(llm) as http:
        reply = await chat_with_image(http, "what is ", image(6, 70, 42), " here?", NEW_TOKENS)
    # The same request offline gives HF's tokens, and its text is what the server answered (a random
    # model's bytes decode to partial characters, so tokens are compared where they can be).
    text, decoded = prompt(f"what is {IMAGE} here?"), png_data_uri(image(6, 70, 42))[1]
    (offline,) = llm.generate(request(text, [decoded]), GREEDY)
    assert offline.outputs[0].token_ids == hf_greedy(checkpoint, text, [decoded])
    assert reply.choices[0].message.content == offline.outputs[0].text
    gc.collect()
    assert len(llm.engine.core.executor.runner.encoder_cache) == 0
    assert_no_leak(llm.engine)
