"""A vision-language model through the server, in process over a real engine, with data-URI images
(tests/models/test_llava.py, tests/models/test_qwen2_vl.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

GREEDY_FIELDS = {"temperature": 0, "ignore_eos": True}


def png_data_uri(image: Any) -> tuple[str, Any]:
    """``image`` (PIL) as a PNG data URI, and the image as the server will decode it (RGB)."""
    from PIL import Image

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    decoded = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), decoded


@asynccontextmanager
async def in_process_server(llm: Any) -> AsyncIterator[Any]:
    """An httpx client of the OpenAI server app over ``llm``'s engine core (started, then shut down)."""
    import httpx

    from pagedserve.server.api.app import ServerSettings, build_app
    from pagedserve.server.engine.async_engine import AsyncEngine

    engine = AsyncEngine(llm.engine.core, llm.engine.tokenizer, llm.engine.processor)
    await engine.start()
    try:
        app = build_app(engine, ServerSettings(access_log=False))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as http:  # fmt: skip
            yield http
    finally:
        await engine.shutdown(grace_seconds=0)


async def chat_with_image(http: Any, before: str, image: Any, after: str, max_tokens: int) -> Any:
    """One user message ``before`` + the image (a data-URI part) + ``after``, greedy and ignoring EOS,
    sent by the openai client; its ChatCompletion."""
    import openai

    url, _ = png_data_uri(image)
    content = [{"type": "text", "text": before}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": after}]  # fmt: skip
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    models = await client.models.list()
    return await client.chat.completions.create(
        model=models.data[0].id, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        temperature=0, extra_body={"ignore_eos": True},
    )


def assert_greedy_batch(llm: Any, requests: list[Any], expected: list[list[int]], params: Any) -> None:
    """``requests`` in one batch give ``expected`` tokens; after them no image's features stay cached."""
    import gc

    outputs = llm.generate(requests, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    del outputs
    gc.collect()
    assert len(llm.engine.core.executor.runner.encoder_cache) == 0  # features leave with their requests
