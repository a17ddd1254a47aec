from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest

from pagedserve.testing.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> str:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture()
def raw_post():
    """``raw_post(base_url, path, body, body_bytes=None) -> socket``: a POST written on a plain socket, so a
    test decides exactly when the client goes away (``sock.close()``), before or after any byte of the
    answer. ``body_bytes``: send only that many bytes of the body (a client that leaves mid-request)."""
    opened: list[socket.socket] = []

    def post(base_url: str, path: str, body: dict, body_bytes: int | None = None) -> socket.socket:
        parts = urlsplit(base_url)
        sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        opened.append(sock)
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data[: len(data) if body_bytes is None else body_bytes])
        return sock

    yield post
    for sock in opened:
        sock.close()
