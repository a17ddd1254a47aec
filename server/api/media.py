"""Images of chat content parts, loaded for the engine: data URIs, http(s) URLs and (when allowed) files.

Each ``image_url`` part becomes one RGB ``PIL.Image.Image`` (vLLM converts to RGB too: the checkpoints'
image processors expect three channels). Every load is bounded, because the bytes come from the client
or from a host the client names:

- **bytes**: at most ``max_image_bytes`` of encoded image, whatever its source (a fetch stops reading
  past it; a file is measured before it is read);
- **pixels**: at most ``max_image_pixels``, read from the header before any pixel is decoded, so a small
  file that claims a huge canvas (a decompression bomb) is refused without allocating it;
- **time**: a fetch, redirects included, ends at ``fetch_timeout_s``;
- **where from**: vLLM's ``--allowed-media-domains`` (unset: any host, as vLLM) is checked on every hop
  of a redirect; files only under vLLM's ``--allowed-local-media-path`` (unset: none).

Decoding runs on a worker thread: a large JPEG takes tens of milliseconds the event loop keeps for other
requests. Every failure is an ``APIError`` 400 whose ``param`` names the part
(``messages[0].content[1].image_url``), as vLLM answers a bad image.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
from pagedserve.common.errors import APIError
from PIL import Image

# Encoded formats taken: OpenAI's list (PNG, JPEG, WebP, non-animated GIF; a GIF's first frame is used).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_IMAGE_BYTES = 20 << 20  # OpenAI's bound of one image
MAX_IMAGE_PIXELS = 6144 * 6144  # about 38 M pixels (a 48 MP phone photo is over it; 12 MP ones are not)
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class MediaSettings:
    """Where images may come from and how big they may be (server/api/app.py ``ServerSettings``)."""

    allowed_domains: frozenset[str] | None = None  # --allowed-media-domains; None: any host
    allowed_local_path: Path | None = None  # --allowed-local-media-path; None: no files
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    fetch_timeout_s: float = FETCH_TIMEOUT_S


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: its URL and the request field that names it in errors."""

    url: str
    param: str  # e.g. messages[0].content[1].image_url


class ImageError(ValueError):
    """Why one image cannot be used; ``ImageLoader.load`` turns it into a 400 naming the part."""


class ImageLoader:
    """Loads a request's images under ``settings``; one per app (it holds the HTTP client's pool)."""

    def __init__(self, settings: MediaSettings) -> None:
        self.settings = settings
        self._client: httpx.AsyncClient | None = None  # made on the first fetch, closed by aclose()

    async def load(self, refs: Sequence[ImageRef]) -> list[Image.Image]:
        """All of ``refs``, loaded concurrently, in order; the first failure is a 400 naming its part (and
        stops the other loads: they would be thrown away)."""
        tasks = [asyncio.ensure_future(self._load_one(ref)) for ref in refs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _load_one(self, ref: ImageRef) -> Image.Image:
        try:
            data = await self._read(ref.url)
            return await asyncio.to_thread(decode_image, data, self.settings.max_image_pixels)
        except ImageError as exc:
            raise APIError(f"{ref.param}: {exc}", 400, param=ref.param) from exc

    async def _read(self, url: str) -> bytes:
        """The encoded image ``url`` points at, bounded in bytes (and, for a fetch, in time)."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "data":
            return await asyncio.to_thread(data_uri_bytes, url, self.settings.max_image_bytes)
        if scheme in ("http", "https"):
            return await self._fetch(url)
        if scheme in ("file", ""):
            return await asyncio.to_thread(self._read_file, url)
        raise ImageError(f"unsupported URL scheme {scheme!r}: send a data: URI or an http(s) URL.")

    # ---- http(s) ---------------------------------------------------------------------------------------

    async def _fetch(self, url: str) -> bytes:
        timeout = self.settings.fetch_timeout_s
        try:
            return await asyncio.wait_for(self._fetch_unbounded(url), timeout)
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            raise ImageError(f"fetching the image timed out after {timeout:g} s.") from exc
        except httpx.TooManyRedirects as exc:
            raise ImageError(f"fetching the image took more than {MAX_REDIRECTS} redirects.") from exc
        except httpx.HTTPError as exc:  # connection refused, bad TLS, malformed URL...
            raise ImageError(f"fetching the image failed: {type(exc).__name__}: {exc}") from exc

    async def _fetch_unbounded(self, url: str) -> bytes:
        """The response body, read no further than the byte bound (the caller bounds the time). The
        client's request hook checks the host of this request and of every redirect."""
        limit = self.settings.max_image_bytes
        async with self.client().stream("GET", url) as response:
            if response.status_code != 200:
                raise ImageError(f"fetching the image returned HTTP {response.status_code}.")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise ImageError(f"the image is larger than {limit} bytes.")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limit:  # a missing or lying Content-Length: stop reading here
                    raise ImageError(f"the image is larger than {limit} bytes.")
            return bytes(body)

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=True,
                max_redirects=MAX_REDIRECTS,
                timeout=self.settings.fetch_timeout_s,
                # A redirect is a new request: its host is checked against the allow-list as well.
                event_hooks={"request": [self._check_request_host]},
            )
        return self._client

    async def _check_request_host(self, request: httpx.Request) -> None:
        self.check_host(str(request.url))

    def check_host(self, url: str) -> None:
        """vLLM's rule: with --allowed-media-domains, the URL's host must be one of them, exactly."""
        allowed = self.settings.allowed_domains
        host = urlsplit(url).hostname
        if allowed is not None and host not in allowed:
            raise ImageError(
                f"the host {host!r} is not in --allowed-media-domains ({', '.join(sorted(allowed))})."
            )

    # ---- files -----------------------------------------------------------------------------------------

    def _read_file(self, url: str) -> bytes:
        """A file under --allowed-local-media-path (symlinks resolved first: none leads out of it)."""
        root = self.settings.allowed_local_path
        if root is None:
            raise ImageError("local files are not allowed: the server has no --allowed-local-media-path.")
        parts = urlsplit(url)
        raw = unquote(parts.path) if parts.scheme else url
        if parts.scheme and parts.netloc not in ("", "localhost"):
            raise ImageError(f"file URLs must name a local file, not host {parts.netloc!r}.")
        path = Path(raw).resolve()
        if not path.is_relative_to(root.resolve()):
            raise ImageError("the file is outside --allowed-local-media-path.")
        try:
            size = os.stat(path).st_size
            if size > self.settings.max_image_bytes:
                raise ImageError(f"the image is larger than {self.settings.max_image_bytes} bytes.")
            return path.read_bytes()
        except OSError as exc:
            raise ImageError(f"cannot read the file: {exc.strerror or exc}.") from exc


def data_uri_bytes(url: str, limit: int) -> bytes:
    """The payload of ``data:<media type>;base64,<payload>``, strictly decoded (as vLLM decodes it)."""
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise ImageError("a data URI must be data:<media type>;base64,<data>.")
    if len(payload) * 3 // 4 > limit + 3:  # measured before decoding: no buffer of an oversize image
        raise ImageError(f"the image is larger than {limit} bytes.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data URI is not valid base64: {exc}.") from exc


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """The encoded ``data`` as an RGB image, its size checked from the header before decoding."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"the image has {width}x{height} pixels, more than {max_pixels}.")
        image.load()
        return image.convert("RGB")
    except Image.DecompressionBombError as exc:  # Pillow's own bound, should it be lower than ours
        raise ImageError(f"the image has too many pixels: {exc}") from exc
    except ImageError:
        raise
    except (OSError, SyntaxError, ValueError) as exc:  # UnidentifiedImageError is an OSError
        raise ImageError(
            f"cannot decode the image (PNG, JPEG, WebP or GIF expected): {type(exc).__name__}: {exc}"
        ) from exc
