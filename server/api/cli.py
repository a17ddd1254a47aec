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
import re
import textwrap
import threading
from collections.abc import Iterator

from pagedserve.common.chat_template import TemplateLimits
from pagedserve.server.api.tool_parsers import TOOL_PARSERS
from pagedserve.server.log import configure_logging

API_KEY_ENV = "PAGEDSERVE_API_KEY"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def human_bytes(value: str) -> int:
    """`1073741824`, `1G`, `1GiB`, `512M`: decimal units for K/M/G/T, binary with an `i`."""
    match = _SIZE.match(value)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {value!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " kmgt".index(unit.lower() or " "))


# The serve help's epilog, filled in when help is printed (_ServeHelpFormatter): the model registry
# imports torch, and every subcommand's parser is built for `pagedserve router --help` too.
_ARCHITECTURES_EPILOG = "supported architectures (config.json's \"architectures\")"


_STRUCTURED_OUTPUTS_EPILOG = (
    "structured outputs (request fields, on /v1/completions and /v1/chat/completions; README.md, "
    "'Structured outputs and tool calls'): response_format {\"type\": \"json_object\"} or {\"type\": "
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
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF folder or hub id (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--model", default=None, help="same as MODEL")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) the API accepts; the first is reported (default: MODEL)",
    )
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
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument(
        "--kv-cache-memory-bytes",
        type=human_bytes,
        default=None,
        help="KV cache budget in bytes (e.g. 2G, 512MiB)",
    )
    offload = engine.add_mutually_exclusive_group()
    offload.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GIB",
        help="a CPU (host memory) KV tier of this many GiB behind the device pool: blocks evicted from the "
        "device go there, and prefix hits there are copied back instead of recomputed (vLLM's flag)",
    )
    offload.add_argument(
        "--kv-offload-bytes",
        type=human_bytes,
        default=None,
        help="the same tier's size in bytes (e.g. 8G, 512MiB)",
    )
    engine.add_argument(
        "--kv-offloading-backend",
        default=None,
        choices=["native"],
        help="the tier's backend (vLLM's flag): native, the only one here and the default",
    )
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decode step before the previous one's tokens are read back, hiding the host's "
        "work behind the device's (default: on a GPU); outputs are unchanged",
    )
    engine.add_argument(
        "--generation-config",
        default="auto",
        help="request defaults from generation_config.json: auto (the model's), vllm (none) or a folder",
    )
    engine.add_argument(
        "--enable-kv-events",
        action="store_true",
        help="publish KV cache events (blocks stored, removed, cleared) on GET /v1/kv_events, for "
        "`pagedserve router --strategy kv-events`",
    )
    engine.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8 or fp8_e4m3 (the same)"
    )
    engine.add_argument(
        "--calculate-kv-scales", action="store_true", help="fp8 KV cache scales from the first prefill"
    )
    engine.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys: e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'',
    )
    engine.add_argument(
        "--quantization", "-q", default=None,
        help="weight format: int8 (weight-only, per output channel, quantized at load), fp8 (e4m3 weights "
        "per output channel and activations per token, FP8 tensor cores on a Hopper GPU) or gguf (a .gguf "
        "model's own Q8_0/Q4_0/Q4_1 blocks); default: gguf for a .gguf model, the embedded one included, on "
        "one CPU rank, else none (the weights' own float dtype)",
    )  # fmt: skip
    engine.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
        help="split the model across N ranks, one process each (gloo on the CPU, NCCL on GPUs 0..N-1); "
        "N must divide the query heads, and divide or be divided by the KV heads",
    )  # fmt: skip
    engine.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT folders or HF ids) on the base model: a request's model names one; "
        "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, POST /v1/load_lora_adapter {lora_name, lora_path} "
        "and /v1/unload_lora_adapter {lora_name} change them at run time",
    )
    engine.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch")
    engine.add_argument("--max-lora-rank", type=int, default=16, help="the highest adapter rank served")
    engine.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in CPU memory (default --max-loras)"
    )
    engine.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='adapters loaded at start: name=path, or JSON {"name": ..., "path": ..., "base_model_name"}',
    )


def engine_config(args: argparse.Namespace):  # -> EngineConfig (imported lazily: it pulls torch)
    from pagedserve.server.config import GIB, EngineConfig

    names = args.served_model_name
    return EngineConfig(
        model=args.model_tag or args.model,
        tokenizer=args.tokenizer,
        served_model_name=names[0] if names else None,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_offloading_size=args.kv_offload_bytes / GIB if args.kv_offload_bytes else args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        generation_config=args.generation_config,
        enable_kv_events=args.enable_kv_events,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=args.lora_modules,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def run(args: argparse.Namespace) -> int:
    configure_logging(logging.DEBUG if args.uvicorn_log_level in ("debug", "trace") else logging.INFO)
    log = logging.getLogger("pagedserve.api")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        log.error("--enable-auto-tool-choice needs --tool-call-parser (one of %s)", ", ".join(TOOL_PARSERS))
        return 2
    try:
        config = engine_config(args)
    except ValueError as exc:
        log.error("invalid engine configuration: %s", exc)
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
        served_model_names=args.served_model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        access_log=not args.disable_access_log,
        shutdown_grace_seconds=args.shutdown_grace_period,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_limits=TemplateLimits(timeout_s=args.chat_template_timeout),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
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
