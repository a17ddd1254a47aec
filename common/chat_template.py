"""Chat templates rendered in a bounded sandbox: the engine server's and the router's one renderer.

A chat template is code: the model's comes from the Hub, a request's from the client. Every template
renders here, in Jinja's ``ImmutableSandboxedEnvironment`` (no attribute escapes, no mutation of the
inputs) with three bounds the stock sandbox lacks:

- **size**: ``*``, ``**``, ``%`` and ``+`` are intercepted, as is ``~`` (string concatenation), and every
  call and filter whose integer argument could make a huge string (``'x'.center(10**10)``) is refused
  before it allocates; the rendered text is cut off once it passes ``max_output_chars``.
- **time**: a render runs on a thread of its own and is interrupted at ``timeout_s``
  (``PyThreadState_SetAsyncExc``). A thread, not a subprocess: the template's inputs (the conversation,
  the tools) need no pickling, a render costs no process start, and Jinja's loops are pure Python, so
  the interrupt lands within one bytecode of the deadline. The caller's event loop keeps serving
  meanwhile (the GIL switches every few milliseconds).
- **trust**: a template sent with a request (``chat_template``, or ``chat_template_kwargs
  ["chat_template"]``) is refused unless the server trusts request templates
  (``--trust-request-chat-template``, as in vLLM).

HF's template features stay: the environment takes transformers' own globals, filters and extensions
(``raise_exception``, ``tojson``, ``strftime_now``, ``namespace``, ``loopcontrols``, ``{% generation %}``)
from ``transformers.utils.chat_template_utils``; ``tools``, ``documents`` and ``continue_final_message``
mean what they mean in ``apply_chat_template``.

Torch-free: the router (router/hashing.py) imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

_DIGITS = re.compile(r"\d+")
# Marks the end of the final message when continuing it (transformers uses the same device).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# apply_chat_template's own parameters: chat_template_kwargs cannot override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
UNTRUSTED_MESSAGE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


class ChatTemplateError(ValueError):
    """A template that cannot render these inputs (bad syntax, raise_exception, over a bound): the
    request's fault, a 400. ``param`` names the request field to blame."""

    def __init__(self, message: str, param: str = "chat_template") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class UntrustedChatTemplateError(ChatTemplateError):
    """A request brought its own template and request templates are not trusted."""


class _Deadline(BaseException):
    """Raised inside a render thread at its deadline (a BaseException: templates cannot catch it)."""


@dataclass(frozen=True)
class TemplateLimits:
    timeout_s: float = 5.0  # wall-clock bound of one render
    max_output_chars: int = 4_000_000  # rendered text, and any string or list built while rendering

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_output_chars:
            raise SecurityError(f"{what} would exceed {self.max_output_chars} items")


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a size-checked join (Jinja's own goes straight to ``str.join``)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox whose operators and calls cannot build objects above the limits."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, limits: TemplateLimits, **options: Any) -> None:
        super().__init__(**options)
        self.limits = limits

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check = self.limits.check_size
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    check(len(seq) * times, "repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            check(right * max(abs(left).bit_length() - 1, 0) // 8, "power (bytes)")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
            check(len(left) + len(right), "concatenation")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left, right if isinstance(right, tuple) else (right,))
        return super().call_binop(context, operator, left, right)

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        text = "".join(str(part) for part in parts)
        self.limits.check_size(len(text), "concatenation")
        return text

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self._check_arguments(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``'{:999999999}'.format(x)``: the sandbox's own wrapper of ``str.format``, after a width check."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            self._check_format(value.__self__, ())
        return wrapped

    def _check_arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """An integer argument above the size bound is a width or count that would allocate it."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                self.limits.check_size(abs(value), "an argument")

    def _check_format(self, fmt: str, args: tuple[Any, ...]) -> None:
        """Widths and precisions written in a format string, or passed to ``%*d``."""
        for digits in _DIGITS.findall(fmt):
            if len(digits) > 18 or int(digits) > self.limits.max_output_chars:
                raise SecurityError("a format width exceeds the size bound")
        self._check_arguments(args, {})

    def bounded_filter(self, filter_func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(filter_func)  # keeps jinja's pass_context/pass_environment marks
        def checked(*args: Any, **kwargs: Any) -> Any:
            self._check_arguments(args, kwargs)
            if getattr(filter_func, "__name__", "") == "do_format" and args and isinstance(args[0], str):
                self._check_format(args[0], ())
            return filter_func(*args, **kwargs)

        return checked


@functools.lru_cache(maxsize=8)
def _environment(limits: TemplateLimits) -> BoundedSandbox:
    """One environment per limits, with transformers' chat-template globals, filters and extensions."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    hf_env = _compile_jinja_template("").environment  # transformers' own set-up, taken as it is
    env = BoundedSandbox(limits, trim_blocks=True, lstrip_blocks=True)
    for extension in hf_env.extensions.values():
        env.add_extension(type(extension))
    env.globals.update(hf_env.globals)
    env.filters.update(hf_env.filters)
    env.filters = {name: env.bounded_filter(f) for name, f in env.filters.items()}
    return env


@functools.lru_cache(maxsize=64)
def compile_template(source: str, limits: TemplateLimits) -> Any:  # -> jinja2.Template
    try:
        return _environment(limits).from_string(source)
    except Exception as exc:  # a syntax error, or nesting deep enough to exhaust the parser's recursion
        raise ChatTemplateError(f"The chat template does not compile: {type(exc).__name__}: {exc}") from exc


def request_template(chat_template: str | None, chat_template_kwargs: Mapping[str, Any] | None) -> str | None:
    """The template a request brings, in either of vLLM's places for it (the field wins)."""
    if chat_template is not None:
        return chat_template
    value = (chat_template_kwargs or {}).get("chat_template")
    return value if value is not None else None


@dataclass
class ChatTemplateRenderer:
    """Renders conversations with the model's template, or a request's when those are trusted.

    ``variables``: what every render sees besides the conversation (the tokenizer's special tokens:
    ``bos_token``, ``eos_token``... as transformers passes them).
    """

    default_template: str | None
    variables: dict[str, Any] = field(default_factory=dict)
    trust_request_templates: bool = False
    limits: TemplateLimits = field(default_factory=TemplateLimits)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, **kwargs: Any) -> ChatTemplateRenderer:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        variables = dict(getattr(tokenizer, "special_tokens_map", None) or {})
        return cls(template if isinstance(template, str) else None, variables, **kwargs)

    def template_for(self, request_template: str | None) -> str:
        """The source to render: the request's (if trusted), else the model's."""
        if request_template is not None:
            if not self.trust_request_templates:
                raise UntrustedChatTemplateError(UNTRUSTED_MESSAGE)
            return request_template
        if self.default_template is None:
            raise ChatTemplateError("The model has no chat template; send one with the request.")
        return self.default_template

    def render(self, messages: list[dict[str, Any]], **options: Any) -> str:
        """Render on a bounded thread, blocking the caller until it ends (at most ``timeout_s``).

        ``options``: ``request_template``, ``tools``, ``documents``, ``add_generation_prompt``,
        ``continue_final_message`` and ``kwargs`` (chat_template_kwargs), as ``apply_chat_template``
        takes them.
        """
        return self._job(messages, **options).run_blocking()

    async def render_async(self, messages: list[dict[str, Any]], **options: Any) -> str:
        """As ``render``, awaited: the event loop serves other requests while the template runs."""
        return await self._job(messages, **options).run_async()

    def _job(
        self,
        messages: list[dict[str, Any]],
        *,
        request_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> _RenderJob:
        source = self.template_for(request_template)
        extra = {k: v for k, v in (kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
        context = {**self.variables, **extra}
        context.update(tools=tools, documents=documents, add_generation_prompt=add_generation_prompt)
        # Copies: the continue tag and the parsed tool-call arguments below must not touch the caller's.
        messages = [_with_parsed_arguments(dict(m)) for m in messages]
        final = None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message needs a final message with text.", "messages")
            messages[-1]["content"] = final + _CONTINUE_TAG
        context["messages"] = messages

        def render() -> str:
            template = compile_template(source, self.limits)  # here: compiling is bounded by the deadline too
            text = self._generate(template, context)
            return text if final is None else _cut_at_continue_tag(text, final)

        return _RenderJob(render, self.limits.timeout_s)

    def _generate(self, template: Any, context: dict[str, Any]) -> str:
        pieces, size, limit = [], 0, self.limits.max_output_chars
        try:
            for piece in template.generate(**context):
                size += len(piece)
                if size > limit:
                    raise ChatTemplateError(f"The chat template rendered more than {limit} characters.")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except SecurityError as exc:
            raise ChatTemplateError(f"The chat template exceeded a bound: {exc}") from exc
        except Exception as exc:  # raise_exception, a wrong type in a message...: the request's inputs
            raise ChatTemplateError(
                f"Cannot apply the chat template: {type(exc).__name__}: {exc}", "messages"
            ) from exc
        return "".join(pieces)


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls with their arguments as objects, as HF templates read them
    (``tool_call.arguments | tojson``); OpenAI sends them as JSON text. As vLLM does: text that is not
    JSON stays text, no arguments become {}."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and not isinstance(function.get("arguments"), (dict, list)):
            arguments = function.get("arguments") or "{}"
            with contextlib.suppress(TypeError, ValueError):
                arguments = json.loads(arguments)
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def _cut_at_continue_tag(text: str, final: str) -> str:
    """The rendered text ending where the final message ends, so generation continues it."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message is set but the chat template drops the final message.", "messages"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


class _RenderJob:
    """One render on its own thread, interrupted at its deadline."""

    def __init__(self, render: Callable[[], str], timeout_s: float) -> None:
        self.render = render
        self.timeout_s = timeout_s
        self.result: str | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.on_done: Callable[[], None] | None = None  # set before start by an awaiting caller
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="chat-template", daemon=True)

    def _run(self) -> None:
        try:  # the outer try also catches a deadline that lands while leaving the inner one
            try:
                self.result = self.render()
            finally:
                with self._lock:
                    self._running = False
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()
            if self.on_done is not None:
                self.on_done()

    def _interrupt(self) -> None:
        with self._lock:
            if self._running and self._thread.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread.ident), ctypes.py_object(_Deadline)
                )

    def _outcome(self) -> str:
        if isinstance(self.error, _Deadline) or not self.done.is_set():
            raise ChatTemplateError(f"The chat template took longer than {self.timeout_s:g} s to render.")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def run_blocking(self) -> str:
        self._thread.start()
        if not self.done.wait(self.timeout_s):
            self._interrupt()
            self.done.wait(1.0)  # the interrupt lands within a bytecode unless C code holds the thread
        return self._outcome()

    async def run_async(self) -> str:
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def wake() -> None:
            if not finished.done():
                finished.set_result(None)

        self.on_done = lambda: loop.call_soon_threadsafe(wake)
        self._thread.start()
        try:
            await asyncio.wait_for(asyncio.shield(finished), self.timeout_s)
        except TimeoutError:
            self._interrupt()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(finished), 1.0)
        except asyncio.CancelledError:  # the client left: stop rendering for it
            self._interrupt()
            raise
        return self._outcome()
