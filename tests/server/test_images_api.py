"""Image content parts on the API side (issue 42): what reaches the engine, and every refusal a 400
naming the part. The engine is the scripted one (pagedserve/testing/api_fakes.py); the requests it is
handed are recorded, and forwarded without their images (the scripted model reads no pixels)."""

from __future__ import annotations

import argparse
import base64
import io
import random
import struct
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pagedserve.server.api.cli import add_arguments, media_settings
from pagedserve.server.api.media import MAX_IMAGE_PIXELS, MediaSettings
from PIL import Image

from pagedserve.testing import api_fakes
from pagedserve.testing.api_fakes import FakeEngine, app_client, assert_400, scripted
from pagedserve.testing.net import free_port

# A multimodal template's way with parts (Qwen2-VL's, LLaVA's): text as it is, each image as its slot.
VLM_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}<image>"
    "{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SLOT = "<image>"
IMAGE_PARAM = "messages[0].content[1].image_url"


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def picture(width: int = 8, height: int = 6) -> Image.Image:
    """A small RGB image with distinct pixels (a format that drops a channel would show)."""
    image = Image.new("RGB", (width, height))
    image.putdata([(x * 30 % 256, y * 40 % 256, 200) for y in range(height) for x in range(width)])
    return image


def ask(url: str, **fields: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            **fields}


class Recorder:
    """The prompts the server hands the engine."""

    def __init__(self) -> None:
        self.prompts: list[Any] = []

    @property
    def images(self) -> list[Image.Image]:
        return self.prompts[-1]["multi_modal_data"]["image"]


@pytest.fixture
def recorder(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    add_request = engine.add_request
    engine.tokenizer.chat_template = VLM_TEMPLATE  # read by build_app: set before the app is built

    async def recording(request_id: str, prompt: Any, params: Any, lora: Any = None) -> Any:
        recorder.prompts.append(prompt)
        text_only = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        return await add_request(request_id, text_only, params, lora)

    monkeypatch.setattr(engine, "add_request", recording)
    return recorder


@pytest.fixture
async def client(engine: FakeEngine, recorder: Recorder) -> AsyncIterator[httpx.AsyncClient]:
    async with await app_client(engine) as c:
        yield c


async def client_with(engine: FakeEngine, **media: Any) -> httpx.AsyncClient:
    return await app_client(engine, media=MediaSettings(**media))


# ---- a local image host ---------------------------------------------------------------------------------


class ImageHost:
    """An HTTP server on 127.0.0.1: /img.png, /missing (404), /slow (answers after 3 s), /redirect
    (to the same image at "localhost"), /endless (a body with no Content-Length that never ends)."""

    def __init__(self, image: bytes) -> None:
        self.port = free_port()
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/img.png":
                    self._send(200, image)
                elif self.path == "/slow":
                    time.sleep(3)
                    self._send(200, image)
                elif self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", f"http://localhost:{host.port}/img.png")
                    self.end_headers()
                elif self.path == "/endless":
                    self.send_response(200)
                    self.end_headers()
                    try:
                        for _ in range(1000):
                            self.wfile.write(b"\0" * 65536)
                    except OSError:  # the server stopped reading at its byte bound, as it should
                        pass
                else:
                    self._send(404, b"no")

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@pytest.fixture(scope="module")
def image_host() -> Iterator[ImageHost]:
    host = ImageHost(encoded(picture()))
    host.thread.start()
    yield host
    host.server.shutdown()
    host.server.server_close()


# ---- what reaches the engine --------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "media_type"), [("PNG", "image/png"), ("WEBP", "image/webp")])
async def test_a_data_uri_image_reaches_the_engine_as_a_pil_image_in_its_slot(
    client: httpx.AsyncClient, recorder: Recorder, engine: FakeEngine, fmt: str, media_type: str
) -> None:
    image = picture()
    lossless = {"lossless": True} if fmt == "WEBP" else {}
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **lossless)
    response = await client.post("/v1/chat/completions", json=ask(data_uri(buffer.getvalue(), media_type)))
    assert response.status_code == 200, response.text
    prompt = recorder.prompts[-1]
    assert prompt["prompt"] == f"<user>What is this?{SLOT}\n<assistant>"
    assert "prompt_token_ids" not in prompt  # the engine's processor tokenizes text and images together
    (got,) = recorder.images
    assert isinstance(got, Image.Image) and got.mode == "RGB" and got.size == image.size
    assert got.tobytes() == image.tobytes()
    # Usage counts the prompt as the engine tokenized it (a real one expands each image's slot).
    assert response.json()["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt["prompt"]))


async def test_images_arrive_in_the_order_of_their_parts_across_messages(
    client: httpx.AsyncClient, recorder: Recorder
) -> None:
    sizes = [(3, 2), (5, 4), (7, 1)]
    uris = [data_uri(encoded(picture(*size))) for size in sizes]
    jpeg = data_uri(encoded(picture(9, 9), "JPEG"), "image/jpeg")
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uris[0]}},
                                     {"type": "image_url", "image_url": {"url": uris[1], "detail": "low"}}]},
        {"role": "assistant", "content": "Two pictures."},
        {"role": "user", "content": [{"type": "text", "text": "And"},
                                     {"type": "image_url", "image_url": {"url": uris[2]}},
                                     {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": jpeg}}]},
    ]
    response = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert [image.size for image in recorder.images] == [*sizes, (9, 9)]
    assert recorder.prompts[-1]["prompt"] == (
        f"<user>{SLOT}{SLOT}\n<assistant>Two pictures.\n<user>And{SLOT}and{SLOT}\n<assistant>"
    )
    metrics = (await client.get("/metrics")).text
    assert 'pagedserve:image_inputs_total{engine="0",model_name="fake-model"} 4.0' in metrics


async def test_text_only_requests_send_what_they_sent_before(
    client: httpx.AsyncClient, recorder: Recorder, engine: FakeEngine
) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    response = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
    prompt = recorder.prompts[-1]
    text = "<user>one\ntwo\n<assistant>"  # text parts joined into one string, as always
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert prompt == {"prompt": text, "prompt_token_ids": ids}
    metrics = (await client.get("/metrics")).text
    assert 'pagedserve:image_inputs_total{engine="0",model_name="fake-model"} 0.0' in metrics


async def test_the_openai_client_sends_an_image_and_gets_an_answer(
    engine: FakeEngine, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = scripted(monkeypatch, "A gradient.")
    async with await app_client(engine) as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        reply = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "Describe it."},
                {"type": "image_url", "image_url": {"url": data_uri(encoded(picture())), "detail": "auto"}},
            ]}],
            **stop,
        )
    assert reply.choices[0].message.content == "A gradient."
    assert recorder.images[0].size == (8, 6)
    assert api_fakes.SCRIPT.startswith("A gradient.")


# ---- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64,%%%notbase64", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"plain text, not an image").decode(), "cannot decode"),
        ("data:image/png," + "abc", "data:<media type>;base64"),
        ("ftp://example.com/a.png", "unsupported URL scheme"),
    ],
)
async def test_an_undecodable_image_is_a_400_naming_the_part(
    client: httpx.AsyncClient, recorder: Recorder, url: str, says: str
) -> None:
    message = assert_400(await client.post("/v1/chat/completions", json=ask(url)), IMAGE_PARAM)
    assert says in message and message.startswith(IMAGE_PARAM)
    assert recorder.prompts == []  # nothing reached the engine


def bomb_png(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims ``width`` x ``height``: tiny, but a huge canvas if decoded."""
    png = encoded(Image.new("RGB", (1, 1)))
    ihdr = struct.pack(">II", width, height) + png[24:29]  # the rest of IHDR as it was
    chunk = b"IHDR" + ihdr
    return png[:12] + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[33:]


async def test_an_oversize_image_is_a_400(engine: FakeEngine, recorder: Recorder) -> None:
    async with await app_client(engine) as client:  # the default bounds
        response = await client.post("/v1/chat/completions", json=ask(data_uri(bomb_png(10_000, 5_000))))
        message = assert_400(response, IMAGE_PARAM)
        assert f"10000x5000 pixels, more than {MAX_IMAGE_PIXELS}" in message
        # Past Pillow's own bound, its DecompressionBombError is the same 400.
        response = await client.post("/v1/chat/completions", json=ask(data_uri(bomb_png(50_000, 50_000))))
        assert "too many pixels" in assert_400(response, IMAGE_PARAM)
    async with await client_with(engine, max_image_pixels=100) as client:
        too_big = ask(data_uri(encoded(picture(11, 10))))
        message = assert_400(await client.post("/v1/chat/completions", json=too_big), IMAGE_PARAM)
        assert "11x10 pixels, more than 100" in message
        ok = await client.post("/v1/chat/completions", json=ask(data_uri(encoded(picture(10, 10)))))
        assert ok.status_code == 200, ok.text
    async with await client_with(engine, max_image_bytes=1000) as client:
        noisy = Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3))  # incompressible
        message = assert_400(await client.post("/v1/chat/completions", json=ask(data_uri(encoded(noisy)))),
                             IMAGE_PARAM)
        assert "larger than 1000 bytes" in message
    assert len(recorder.prompts) == 1


async def test_other_part_types_and_a_part_without_its_url_are_400s(
    client: httpx.AsyncClient, recorder: Recorder
) -> None:
    body = ask("unused")
    body["messages"][0]["content"][1] = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    message = assert_400(await client.post("/v1/chat/completions", json=body), "messages[0].content[1]")
    assert "'input_audio'" in message
    body["messages"][0]["content"][1] = {"type": "image_url"}
    assert_400(await client.post("/v1/chat/completions", json=body), "messages[0].content[1]")
    assert recorder.prompts == []


async def test_image_parts_where_a_prompt_cannot_take_them_are_400s(client: httpx.AsyncClient) -> None:
    url = data_uri(encoded(picture()))
    body = ask(url, truncate_prompt_tokens=10)
    assert_400(await client.post("/v1/chat/completions", json=body), "truncate_prompt_tokens")
    tokenize = {"model": "fake-model", "messages": ask(url)["messages"]}
    assert_400(await client.post("/tokenize", json=tokenize), IMAGE_PARAM)


# ---- URLs and files -----------------------------------------------------------------------------------


async def test_an_http_image_is_fetched_when_its_host_is_allowed(
    engine: FakeEngine, recorder: Recorder, image_host: ImageHost
) -> None:
    for allowed in (None, frozenset({"127.0.0.1"})):
        async with await client_with(engine, allowed_domains=allowed) as client:
            response = await client.post("/v1/chat/completions", json=ask(image_host.url("/img.png")))
        assert response.status_code == 200, response.text
        assert recorder.images[0].tobytes() == picture().tobytes()


async def test_a_disallowed_host_is_a_400_on_every_hop(
    engine: FakeEngine, recorder: Recorder, image_host: ImageHost
) -> None:
    async with await client_with(engine, allowed_domains=frozenset({"images.example.com"})) as client:
        message = assert_400(await client.post("/v1/chat/completions", json=ask(image_host.url("/img.png"))),
                             IMAGE_PARAM)
        assert "'127.0.0.1' is not in --allowed-media-domains (images.example.com)" in message
    async with await client_with(engine, allowed_domains=frozenset({"127.0.0.1"})) as client:
        # 127.0.0.1 redirects to localhost, which is not allowed
        message = assert_400(await client.post("/v1/chat/completions", json=ask(image_host.url("/redirect"))),
                             IMAGE_PARAM)
        assert "'localhost' is not in --allowed-media-domains" in message
    assert recorder.prompts == []


async def test_fetch_failures_are_400s(engine: FakeEngine, recorder: Recorder, image_host: ImageHost) -> None:
    async with await client_with(engine, fetch_timeout_s=0.5, max_image_bytes=1 << 20) as client:
        started = time.monotonic()
        message = assert_400(await client.post("/v1/chat/completions", json=ask(image_host.url("/slow"))),
                             IMAGE_PARAM)
        assert "timed out after 0.5 s" in message and time.monotonic() - started < 2.5
        message = assert_400(await client.post("/v1/chat/completions", json=ask(image_host.url("/missing"))),
                             IMAGE_PARAM)
        assert "HTTP 404" in message
        message = assert_400(await client.post("/v1/chat/completions", json=ask(image_host.url("/endless"))),
                             IMAGE_PARAM)
        assert f"larger than {1 << 20} bytes" in message
        closed = f"http://127.0.0.1:{free_port()}/img.png"
        message = assert_400(await client.post("/v1/chat/completions", json=ask(closed)), IMAGE_PARAM)
        assert "fetching the image failed" in message
    assert recorder.prompts == []


async def test_files_only_under_the_allowed_local_media_path(
    engine: FakeEngine, recorder: Recorder, tmp_path: Path
) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(encoded(picture()))
    (tmp_path / "secret.png").write_bytes(encoded(picture()))
    inside, outside = allowed / "a.png", allowed / ".." / "secret.png"
    async with await app_client(engine) as client:
        for url in (str(inside), inside.as_uri()):
            message = assert_400(await client.post("/v1/chat/completions", json=ask(url)), IMAGE_PARAM)
            assert "no --allowed-local-media-path" in message
    async with await client_with(engine, allowed_local_path=allowed) as client:
        for url in (str(inside), inside.as_uri()):
            response = await client.post("/v1/chat/completions", json=ask(url))
            assert response.status_code == 200, response.text
            assert recorder.images[0].size == (8, 6)
        (allowed / "link.png").symlink_to(tmp_path / "secret.png")
        for url in (str(outside), f"file://{outside}", str(allowed / "link.png")):
            message = assert_400(await client.post("/v1/chat/completions", json=ask(url)), IMAGE_PARAM)
            assert "outside --allowed-local-media-path" in message
        message = assert_400(await client.post("/v1/chat/completions", json=ask(str(allowed / "none.png"))),
                             IMAGE_PARAM)
        assert "cannot read the file" in message
    assert len(recorder.prompts) == 2


def test_the_media_flags_make_the_media_settings(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--allowed-media-domains", "upload.wikimedia.org", "github.com", "--allowed-local-media-path",
         str(tmp_path)]
    )
    assert media_settings(args) == MediaSettings(
        allowed_domains=frozenset({"upload.wikimedia.org", "github.com"}), allowed_local_path=tmp_path
    )
    assert media_settings(parser.parse_args([])) == MediaSettings()


async def test_a_responses_input_image_reaches_the_engine(
    client: httpx.AsyncClient, recorder: Recorder
) -> None:
    content = [{"type": "input_text", "text": "What is this?"},
               {"type": "input_image", "image_url": data_uri(encoded(picture())), "detail": "auto"}]
    body = {"model": "fake-model", "input": [{"role": "user", "content": content}], "max_output_tokens": 4}
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert recorder.prompts[-1]["prompt"] == f"<user>What is this?{SLOT}\n<assistant>"
    assert recorder.images[0].tobytes() == picture().tobytes()
    content[1] = {"type": "input_image", "file_id": "file-1"}
    message = assert_400(await client.post("/v1/responses", json=body), "input[0]")
    assert "file_id is not supported" in message
