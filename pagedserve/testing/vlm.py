"""A vision-language model's chat through the server with the openai client, in process over a real
engine (tests/models/test_llava.py, tests/models/test_qwen2_vl.py)."""

from __future__ import annotations

import base64
import io
from typing import Any


def png_data_uri(image: Any) -> tuple[str, Any]:
    """``image`` (PIL) as a PNG data URI, and the image as the server will decode it (RGB)."""
    from PIL import Image

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    decoded = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), decoded


async def chat_with_image(llm: Any, before: str, image: Any, after: str, max_tokens: int) -> Any:
    """One user message ``before`` + the image (a data-URI part) + ``after``, greedy and ignoring EOS,
    through the OpenAI server app over ``llm``'s engine core; the openai client's ChatCompletion."""
    import httpx
    import openai

    from pagedserve.server.api.app import ServerSettings, build_app
    from pagedserve.server.engine.async_engine import AsyncEngine

    url, _ = png_data_uri(image)
    content = [{"type": "text", "text": before}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": after}]  # fmt: skip
    engine = AsyncEngine(llm.engine.core, llm.engine.tokenizer, llm.engine.processor)
    await engine.start()
    try:
        app = build_app(engine, ServerSettings(access_log=False))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http,
                                        max_retries=0)
            return await client.chat.completions.create(
                model=llm.engine.core.config.served_model_name,
                messages=[{"role": "user", "content": content}],
                max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
            )
    finally:
        await engine.shutdown(grace_seconds=0)
