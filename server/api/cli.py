"""`pagedserve serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names.

The model loads before the port opens, so /health answers only once the server can serve. SIGTERM (or
Ctrl-C) drains (server/api/graceful_stop.py): /health answers 503 at once, new requests get 503, running
requests finish or end with an error event, all within --shutdown-grace-period; then the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

from pagedserve.common.chat_template import TemplateLimits
from pagedserve.common.engine_args import add_cli_arguments, from_cli
from pagedserve.server.api.reasoning_parsers import REASONING_PARSERS
from pagedserve.server.api.tool_parsers import TOOL_PARSERS
from pagedserve.server.log import configure_logging

API_KEY_ENV = "PAGEDSERVE_API_KEY"
# The serve help's epilog, filled in when help is printed (_ServeHelpFormatter): the model registry
# imports torch, and every subcommand's parser is built for `pagedserve router --help` too.
_ARCHITECTURES_EPILOG = "supported architectures (config.json's \"architectures\")"


_STRUCTURED_OUTPUTS_EPILOG = (
    "structured outputs (request fields, on /v1/completions and /v1/chat/completions; "
    "docs/structured-outputs.md): response_format {\"type\": \"json_object\"} or {\"type\": "
    "\"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}; structured_outputs {json | "
    "regex | choice | grammar | json_object | structural_tag, disable_any_whitespace, whitespace_pattern}; "
    "guided_json, guided_regex, guided_choice, guided_grammar; tools with tool_choice none, auto (needs "
    "--enable-auto-tool-choice and --tool-call-parser), required or a named function. One grammar engine, "
    "llguidance (guided_decoding_backend: guidance or auto). A reply cut by max_tokens mid-JSON finishes "
    "with \"length\"."
)


class _ServeHelpFormatter(argparse.RawDescriptionHelpFormatter):
    def add_text(self, text: str | None) -> None:
        if text is _ARCHITECTURES_EPILOG:
            from pagedserve.server.models.registry import supported_architectures

            width = self._width - self._current_indent
            paragraphs = [
                f"{_ARCHITECTURES_EPILOG}: {', '.join(supported_architectures())}",
                _STRUCTURED_OUTPUTS_EPILOG,
            ]
            text = "\n\n".join(textwrap.fill(p, width, break_on_hyphens=False) for p in paragraphs)
        super().add_text(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = _ARCHITECTURES_EPILOG
    parser.formatter_class = _ServeHelpFormatter
    server = parser.add_argument_group("HTTP server")
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        default=None,
        help=f"bearer token required on every route but /health, /metrics, /version and the OpenAPI "
        f"document (default: ${API_KEY_ENV})",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render chat templates sent with requests (chat_template, chat_template_kwargs); without "
        "it such requests get a 400",
    )
    server.add_argument(
        "--chat-template-timeout",
        type=float,
        default=TemplateLimits.timeout_s,
        metavar="SECONDS",
        help="a chat template that renders longer than this gets a 400",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (OpenAI\'s default with tools): the model may call tools, read out of its '
        'reply by --tool-call-parser; without it such requests get a 400. "required" and a named function '
        "need no flag: the grammar forces the calls",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are written in the model's replies (hermes: <tool_call>{json}</tool_call>; "
        "llama3_json: JSON objects separated by ';', optionally after <|python_tag|>)",
    )
    server.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split a reasoning model's replies into reasoning_content and content by its think tags "
        "(qwen3: a reply that opens with <think>; deepseek_r1: everything up to </think>, the prompt "
        "having opened it)",
    )
    server.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="the only hosts image_url parts may be fetched from (exact host names); unset: any host, "
        "as in vLLM. Other hosts get a 400",
    )
    server.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="image_url parts may name files (file:// URLs or paths) under this directory; unset: "
        "files get a 400. Only for trusted clients: it lets them read image files on the server",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    server.add_argument(
        "--engine-core-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process, beside the API's (vLLM V1's default); "
        "--no-engine-core-process steps it on a thread of the API's process",
    )
    server.add_argument(
        "--disable-log-requests",
        "--disable-access-log",
        dest="disable_access_log",
        action="store_true",
        help="no access-log line per request",
    )
    server.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, the bound of the whole stop: running requests finish or are ended with an "
        "error before it (keep it below the pod's terminationGracePeriodSeconds)",
    )
    # Every engine setting, from its one declaration (common/engine_args.py).
    add_cli_arguments(parser.add_argument_group("engine"))


def media_settings(args: argparse.Namespace):  # -> MediaSettings (server/api/media.py imports Pillow)
    from pagedserve.server.api.media import MediaSettings

    domains = args.allowed_media_domains
    local = args.allowed_local_media_path
    return MediaSettings(
        allowed_domains=frozenset(domains) if domains is not None else None,
        allowed_local_path=Path(local) if local is not None else None,
    )


def engine_config(args: argparse.Namespace):  # -> EngineConfig (imported lazily: it pulls torch)
    from pagedserve.server.config import EngineConfig

    return EngineConfig(**from_cli(args))


def run(args: argparse.Namespace) -> int:
    configure_logging(logging.DEBUG if args.uvicorn_log_level in ("debug", "trace") else logging.INFO)
    log = logging.getLogger("pagedserve.api")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        log.error("--enable-auto-tool-choice needs --tool-call-parser (one of %s)", ", ".join(TOOL_PARSERS))
        return 2
    local_media = args.allowed_local_media_path
    if local_media is not None and not Path(local_media).is_dir():
        log.error("--allowed-local-media-path %s is not a directory", local_media)
        return 2
    try:
        config = engine_config(args)
    except ValueError as exc:
        log.error("invalid engine configuration: %s", exc)
        return 2
    if config.headless:  # another node's ranks of a multi-node engine: no API here
        from pagedserve.server.executor.headless import run_headless

        try:
            return run_headless(config)
        except ValueError as exc:
            log.error("cannot start this node's ranks: %s", exc)
            return 2

    import uvicorn
    from pagedserve.server.api.app import ServerSettings, build_app
    from pagedserve.server.engine.async_engine import AsyncEngine

    try:
        engine = AsyncEngine.from_config(config, core_process=args.engine_core_process)
    except ValueError as exc:  # a model the configuration cannot run (e.g. heads that do not split)
        log.error("cannot start the engine: %s", exc)
        return 2
    settings = ServerSettings(
        served_model_names=config.served_model_names,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        access_log=not args.disable_access_log,
        shutdown_grace_seconds=args.shutdown_grace_period,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_limits=TemplateLimits(timeout_s=args.chat_template_timeout),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        media=media_settings(args),
    )
    app = build_app(engine, settings)
    stop = app.state.graceful_stop
    server = _graceful_server(
        stop,
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_config=None,
            log_level=args.uvicorn_log_level,
            access_log=False,  # our own access log, one structured line per request
            # What is left of the grace period once the drain is over (server/api/graceful_stop.py).
            timeout_graceful_shutdown=max(1, round(stop.margin_s)),
        ),
    )
    log.info(
        "serving %s on http://%s:%d",
        ", ".join(settings.served_model_names or [config.served_model_name]),
        args.host,
        args.port,
    )
    engine.on_fatal = lambda error: _exit_on_fatal(server, error, log)
    server.run()
    if engine.fatal_error is not None:
        log.error("the server stopped because the engine failed: %s", engine.fatal_error)
        return 1
    return 0 if server.started else 1


FATAL_EXIT_S = 10.0  # after an engine failure, the most the orderly stop may take before a hard exit


def _exit_on_fatal(server, error: BaseException, log: logging.Logger) -> None:
    """The engine cannot go on (a tensor-parallel rank died): stop serving now, exit non-zero. A stop
    stuck in a collective with the dead rank ends with a hard exit after FATAL_EXIT_S."""
    log.error("stopping the server: %s", error)
    server.should_exit = True
    timer = threading.Timer(FATAL_EXIT_S, os._exit, (1,))
    timer.daemon = True
    timer.start()


def _graceful_server(stop, config):  # (GracefulStop, uvicorn.Config) -> uvicorn.Server
    """A uvicorn.Server that drains before it stops listening, and whose SIGTERM ends in exit code 0.

    uvicorn stops listening at the first signal; here the first SIGTERM or Ctrl-C only starts the drain
    (``stop.drain()``: /health 503, running requests finish or end within the grace period), and uvicorn's
    own shutdown follows it. A second signal goes to uvicorn as usual: it stops listening at once (the
    drain still bounds the wait), and one more Ctrl-C forces the exit.
    uvicorn re-raises the signal once done so that the process dies of it; a server asked to stop has
    stopped cleanly, so the re-raise is dropped.
    """
    import asyncio

    import uvicorn

    class GracefulServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        drain_task: asyncio.Future | None = None

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame) -> None:
            if self.loop is None or stop.draining or self.should_exit:
                super().handle_exit(sig, frame)
                return
            stop.begin()  # /health is 503 from here on
            self.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self.drain_task = asyncio.ensure_future(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            try:
                await stop.drain()
            finally:
                self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    return GracefulServer(config)
