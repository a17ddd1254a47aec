"""Issue 14: the router renders chat templates as the engine does (common/chat_template.py): in the
bounded sandbox, and a request's own template only with --trust-request-chat-template (else the raw
messages are hashed and the engine decides)."""

from __future__ import annotations

import json

import pytest
from pagedserve.common.chat_template import TemplateLimits
from pagedserve.router.cli import config_from_args
from pagedserve.router.hashing import PromptHasher

MSGS = [{"role": "user", "content": "Hello there, how are you today? " * 4}]
TEMPLATE = "{% for m in messages %}[[{{ m.role }}: {{ m.content }}]]{% endfor %}"
# Seconds of pure-Python work in Jinja; the bound stops it.
SLOW_TEMPLATE = "{% for i in range(15000) %}{% for j in range(15000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def untrusting(tiny_tokenizer) -> PromptHasher:
    return PromptHasher(tiny_tokenizer, "tiny-model", block_size=16)


@pytest.fixture(scope="module")
def trusting(tiny_tokenizer) -> PromptHasher:
    limits = TemplateLimits(timeout_s=1.0, max_output_chars=100_000)
    return PromptHasher(
        tiny_tokenizer, "tiny-model", block_size=16, trust_request_chat_template=True, template_limits=limits
    )


def raw_ids(hasher: PromptHasher) -> list[int]:
    """What the router hashes when it does not render: the raw messages."""
    return hasher._bytes_of(json.dumps(MSGS, ensure_ascii=False, sort_keys=True))


@pytest.mark.parametrize(
    "body", [{"chat_template": TEMPLATE}, {"chat_template_kwargs": {"chat_template": TEMPLATE}}]
)
def test_untrusted_request_template_is_not_rendered(untrusting: PromptHasher, body: dict) -> None:
    assert untrusting.chat_token_ids(MSGS, {"messages": MSGS, **body}) == raw_ids(untrusting)
    # the model's own template still renders
    assert untrusting.chat_token_ids(MSGS, {"messages": MSGS}) != raw_ids(untrusting)


@pytest.mark.parametrize(
    "body", [{"chat_template": TEMPLATE}, {"chat_template_kwargs": {"chat_template": TEMPLATE}}]
)
def test_trusted_request_template_is_rendered(trusting: PromptHasher, body: dict) -> None:
    rendered = "".join(f"[[{m['role']}: {m['content']}]]" for m in MSGS)
    ids = trusting.chat_token_ids(MSGS, {"messages": MSGS, **body})
    assert ids == trusting.tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("template", [SLOW_TEMPLATE, "{{ 'x' * 10**10 }}", "{{ 'x'.ljust(10**10) }}"])
def test_trusted_template_beyond_its_bounds_falls_back_to_raw_messages(
    trusting: PromptHasher, template: str
) -> None:
    assert trusting.chat_token_ids(MSGS, {"messages": MSGS, "chat_template": template}) == raw_ids(trusting)


def test_router_flag() -> None:
    import argparse

    from pagedserve.router.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "http://x:1", "--trust-request-chat-template"])
    assert config_from_args(args).trust_request_chat_template is True
    assert (
        config_from_args(parser.parse_args(["--backend", "http://x:1"])).trust_request_chat_template is False
    )
