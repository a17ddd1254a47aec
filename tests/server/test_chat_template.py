"""common/chat_template.py renders as transformers' apply_chat_template does, in its bounded sandbox."""

from __future__ import annotations

import pytest
from pagedserve.common.chat_template import ChatTemplateError, ChatTemplateRenderer, TemplateLimits
from transformers import PreTrainedTokenizerFast

from pagedserve import default_model

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "It is"},
]
# HF's template features, each used once.
FEATURES = (
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m|tojson }}{% endfor %}"
    "{{ tools[0].function.name }}|{{ documents[0].title }}|{{ strftime_now('%Y')|length }}|{{ bos_token }}"
    "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}|{{ dict(a=1).a }}|{{ custom }}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(default_model()))


@pytest.mark.parametrize(
    ("add_generation_prompt", "continue_final_message"), [(True, False), (False, False), (False, True)]
)
def test_model_template_renders_as_transformers(
    tokenizer, add_generation_prompt: bool, continue_final_message: bool
) -> None:
    renderer = ChatTemplateRenderer.for_tokenizer(tokenizer)
    options = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    expected = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, **options)
    assert renderer.render(CONVERSATION, **options) == expected


def test_hf_template_features_work_in_the_sandbox(tokenizer) -> None:
    renderer = ChatTemplateRenderer.for_tokenizer(tokenizer, trust_request_templates=True)
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    documents = [{"title": "Atlas", "text": "..."}]
    kwargs = {"custom": "yes", "messages": "cannot override"}
    options = {"tools": tools, "documents": documents, "kwargs": kwargs}
    expected = tokenizer.apply_chat_template(
        CONVERSATION, chat_template=FEATURES, tokenize=False, tools=tools, documents=documents, custom="yes"
    )
    assert renderer.render(CONVERSATION, request_template=FEATURES, **options) == expected
    with pytest.raises(ChatTemplateError, match="refused"):
        renderer.render(CONVERSATION, request_template="{{ raise_exception('refused') }}")


def test_a_render_past_its_deadline_is_stopped(tokenizer) -> None:
    limits = TemplateLimits(timeout_s=0.5)
    renderer = ChatTemplateRenderer.for_tokenizer(tokenizer, trust_request_templates=True, limits=limits)
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"longer than 0\.5 s"):
        renderer.render(CONVERSATION, request_template=endless)
    assert renderer.render(CONVERSATION, request_template="ok") == "ok"  # the renderer lives on
