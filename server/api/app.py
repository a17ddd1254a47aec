"""The FastAPI application: vLLM's OpenAI-compatible endpoints in front of one ``EngineClient``
(server/engine/protocol.py; server/engine/async_engine.py in production).

``build_app(engine, settings)`` wires the routes, OpenAI-shaped errors, bearer auth on every route but the
probes (server/api/auth.py), the access log and a Prometheus registry of its own; its lifespan starts the
engine thread and, on shutdown, drains within the grace period (server/api/graceful_stop.py).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pagedserve.common.chat_template import ChatTemplateRenderer, TemplateLimits
from pagedserve.common.engine_args import as_dict as engine_args_in_force
from pagedserve.common.errors import error_response, install_error_handlers
from pagedserve.common.routing import INSTANCE_HEADER, new_instance
from pagedserve.server.api.access_log import AccessLogMiddleware
from pagedserve.server.api.auth import APIKeyMiddleware
from pagedserve.server.api.graceful_stop import GracefulStop
from pagedserve.server.api.kv_events import router as kv_events_router
from pagedserve.server.api.media import ImageLoader, MediaSettings
from pagedserve.server.api.metrics import ServerMetrics
from pagedserve.server.api.protocol import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
    unknown_field_message,
)
from pagedserve.server.api.responses import UNSUPPORTED_RESPONSES_FIELDS, ResponsesRequest
from pagedserve.server.api.serving_base import dumps
from pagedserve.server.api.serving_chat import OpenAIServingChat
from pagedserve.server.api.serving_completion import OpenAIServingCompletion
from pagedserve.server.api.serving_pooling import OpenAIServingPooling
from pagedserve.server.api.serving_responses import OpenAIServingResponses
from pagedserve.server.api.serving_tokenization import OpenAIServingTokenization
from pagedserve.server.engine.gc_heap import freeze_startup_heap
from pagedserve.server.engine.protocol import EngineClient
from pagedserve.server.lora_request import LoRALoadError, LoRARequest
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from pagedserve.version import __version__

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    """vLLM's switch for the adapter endpoints: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is 1 or true."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclass
class ServerSettings:
    served_model_names: list[str] | None = None  # default: the engine's served_model_name
    api_key: str | None = None  # bearer token required on every route but the probes
    access_log: bool = True
    # The whole stop, running streams included, fits in this (the pod allows 60 s).
    shutdown_grace_seconds: float = 30.0
    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template
    chat_template_limits: TemplateLimits = field(default_factory=TemplateLimits)
    enable_auto_tool_choice: bool = False  # vLLM's --enable-auto-tool-choice
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser (server/api/tool_parsers/)
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser (server/api/reasoning_parsers/)
    # Where image_url parts may come from, and their bounds (server/api/media.py): vLLM's
    # --allowed-media-domains and --allowed-local-media-path.
    media: MediaSettings = field(default_factory=MediaSettings)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (vLLM's env switch, read at start)
    allow_runtime_lora_updating: bool = field(default_factory=runtime_lora_updating_allowed)


def _unknown_field(name: str, path: str) -> str:
    """A request field its schema does not have: refused by name where its API defines it."""
    refused = UNSUPPORTED_RESPONSES_FIELDS if path.startswith("/v1/responses") else UNSUPPORTED_FIELDS
    return unknown_field_message(name, refused)


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse} for status in statuses}


def _streamed(model: type, stream_model: type) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": f"JSON, or with stream=true server-sent events, each a "
            f"`data: <{stream_model.__name__}>` line, ending with `data: [DONE]`",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    }


def build_app(engine: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    model_names = settings.served_model_names or [engine.served_model_name]
    metrics = ServerMetrics(engine, model_names[0], engine.max_model_len)
    templates = ChatTemplateRenderer.for_tokenizer(
        engine.tokenizer,
        trust_request_templates=settings.trust_request_chat_template,
        limits=settings.chat_template_limits,
    )
    stop = GracefulStop(engine, settings.shutdown_grace_seconds)
    images = ImageLoader(settings.media)
    serving = (engine, model_names, metrics, templates, stop)
    chat = OpenAIServingChat(
        *serving,
        tool_parser=settings.tool_call_parser,
        enable_auto_tool_choice=settings.enable_auto_tool_choice,
        reasoning_parser=settings.reasoning_parser,
        images=images,
    )
    completion = OpenAIServingCompletion(*serving, images=images)
    instance = new_instance()
    responses = OpenAIServingResponses(chat, instance)
    tokenization = OpenAIServingTokenization(*serving)
    pooling = OpenAIServingPooling(*serving)
    auth_errors = (401,) if settings.api_key else ()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        freeze_startup_heap()
        try:
            yield
        finally:
            await stop.drain()  # at once if SIGTERM already drained (server/api/cli.py)
            await images.aclose()

    app = FastAPI(
        title="pagedserve",
        version=__version__,
        description="OpenAI-compatible LLM server (vLLM's endpoints, sampling parameters and metrics).",
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.graceful_stop = stop
    install_error_handlers(app, _unknown_field)

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "The engine is running"}, **_errors(503)},
    )
    async def health() -> Response:
        if stop.draining:
            return error_response("The server is shutting down.", 503)
        if engine.is_healthy():
            return Response(status_code=200, headers={INSTANCE_HEADER: instance})
        return error_response("The engine is not running.", 503)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        from pagedserve.server.backend import cpu_kernel_report
        from pagedserve.server.models.registry import supported_architectures

        return VersionResponse(
            version=__version__,
            backend=engine.config.attention_backend,
            cpu_kernels=cpu_kernel_report(engine.config.attention_backend),
            quantization=engine.config.quantization,
            quantization_reason=getattr(engine.config, "quantization_reason", None) or None,
            kv_cache_dtype=engine.config.kv_cache_dtype,
            kv_offloading_size=getattr(engine.config, "kv_offloading_size", None),
            kv_offloading_backend=getattr(engine.config, "kv_offloading_backend", None),
            speculative_config=asdict(spec) if (spec := engine.config.speculative_config) else None,
            architectures=supported_architectures(),
            enable_lora=bool(getattr(engine.config, "enable_lora", False)),
            max_loras=engine.config.max_loras if getattr(engine.config, "enable_lora", False) else None,
            tensor_parallel_size=getattr(engine.config, "tensor_parallel_size", 1),
            pipeline_parallel_size=getattr(engine.config, "pipeline_parallel_size", 1),
            async_scheduling=bool(getattr(engine.config, "async_scheduling", False)),
            engine_args=engine_args_in_force(engine.config),
        )

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text exposition",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    root = engine.model_path

    def model_card(name: str) -> ModelCard:
        return ModelCard(
            id=name,
            root=root or name,
            max_model_len=engine.max_model_len,
            permission=[ModelPermission(id=f"modelperm-{name}")],
        )

    def lora_card(lora: LoRARequest) -> ModelCard:
        """vLLM's card of an adapter: its path as ``root``, the base served name as ``parent``."""
        return ModelCard(
            id=lora.lora_name,
            root=lora.lora_path,
            parent=model_names[0],
            max_model_len=engine.max_model_len,
            permission=[ModelPermission(id=f"modelperm-{lora.lora_name}")],
        )

    @app.get("/v1/models", response_model=ModelList, responses=_errors(*auth_errors))
    async def list_models() -> ModelList:
        cards = [model_card(name) for name in model_names]
        return ModelList(data=cards + [lora_card(lora) for lora in engine.list_loras()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(*auth_errors, 404))
    async def retrieve_model(model_id: str) -> ModelCard:
        lora = chat.check_model(model_id)
        return model_card(model_id) if lora is None else lora_card(lora)

    if settings.allow_runtime_lora_updating:
        add_lora_routes(app, engine, model_names, auth_errors)

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={
            **_streamed(CompletionResponse, CompletionStreamResponse),
            **_errors(400, *auth_errors, 404, 500, 503),
        },
    )
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(request, raw_request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={
            **_streamed(ChatCompletionResponse, ChatCompletionStreamResponse),
            **_errors(400, *auth_errors, 404, 500, 503),
        },
    )
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post(
        "/v1/responses",
        response_model=None,
        responses={
            200: {"description": "A Response, or with stream=true OpenAI's server-sent response events"},
            **_errors(400, *auth_errors, 404, 500, 503),
        },
    )
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}", responses=_errors(*auth_errors, 404))
    async def retrieve_response(response_id: str) -> Response:
        return Response(dumps(responses.retrieve(response_id)), media_type="application/json")

    @app.post("/v1/responses/{response_id}/cancel", responses=_errors(400, *auth_errors, 404))
    async def cancel_response(response_id: str) -> Response:
        return Response(dumps(responses.cancel(response_id)), media_type="application/json")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, *auth_errors, 404))
    async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        return await tokenization.create_tokenize(request)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, *auth_errors, 404))
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokenization.create_detokenize(request)

    add_pooling_routes(app, pooling, _errors(400, *auth_errors, 404, 500, 503))
    app.include_router(kv_events_router, responses=_errors(*auth_errors))

    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_keys=[settings.api_key])
    if settings.access_log:
        app.add_middleware(AccessLogMiddleware)  # outermost: it logs the 401s too
    return app


def add_pooling_routes(app: FastAPI, pooling: OpenAIServingPooling, errors: dict[int | str, Any]) -> None:
    """The pooling runner's endpoints, at vLLM's paths (score and rerank under each of its prefixes). On a
    generating model each answers a 400 that names the runner it needs."""

    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return _json(await pooling.create_embedding(request, raw_request))

    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return _json(await pooling.create_pooling(request, raw_request))

    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return _json(await pooling.create_score(request, raw_request))

    async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
        return _json(await pooling.create_rerank(request, raw_request))

    routes = [
        (("/v1/embeddings",), create_embedding, "An OpenAI embedding list"),
        (("/pooling",), create_pooling, "vLLM's pooling list: each input's pooled vector"),
        (("/score", "/v1/score"), create_score, "The cosine similarity of each text pair's embeddings"),
        (("/rerank", "/v1/rerank", "/v2/rerank"), create_rerank,
         "The documents by the cosine similarity of their embeddings to the query's"),
    ]
    for paths, endpoint, description in routes:
        for path in paths:
            app.add_api_route(path, endpoint, methods=["POST"], response_model=None,
                              responses={200: {"description": description}, **errors})


def _json(body: dict[str, Any]) -> Response:
    return Response(dumps(body), media_type="application/json")


def add_lora_routes(
    app: FastAPI, engine: EngineClient, model_names: list[str], auth_errors: tuple[int, ...]
) -> None:
    """vLLM's runtime adapter endpoints (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING). Requests in flight
    are never disturbed: a load only adds a name, an unload only stops new requests naming it."""
    # Ids are never reused while the server runs: a slot still held by a running request's adapter is
    # never mistaken for a newer adapter's.
    first_id = max((lora.lora_int_id for lora in engine.list_loras()), default=0) + 1
    lora_ids = itertools.count(first_id)

    @app.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        responses=_errors(400, *auth_errors),
    )
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        if request.lora_name in model_names:
            return error_response(f"The lora adapter '{request.lora_name}' is the base model's name.", 400,
                                  param="lora_name")
        try:
            await engine.add_lora(LoRARequest(request.lora_name, next(lora_ids), request.lora_path))
        except LoRALoadError as exc:
            return error_response(str(exc), 400, param="lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        responses=_errors(*auth_errors, 404),
    )
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        try:
            await engine.remove_lora(request.lora_name)
        except KeyError:
            return error_response(f"The lora adapter '{request.lora_name}' cannot be found.", 404,
                                  param="lora_name", code="model_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
