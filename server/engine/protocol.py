"""``EngineClient``: all that the OpenAI layer (server/api/) may ask of an engine.

server/engine/async_engine.py implements it over the real model, pagedserve/testing/api_fakes.py over a
scripted core; the API's handlers are typed with this protocol and nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve.server.engine.core_output import EngineStats
from pagedserve.server.engine.processor import PromptInput
from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.outputs import RequestOutput
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.sampling_params import SamplingParams

if TYPE_CHECKING:  # config.py imports torch; the API layer does not need it at run time
    from pagedserve.server.config import EngineConfig
    from pagedserve.server.core.kv_events import KVEventPublisher


class RequestStream(Protocol):
    """One request's outputs, as its ``output_kind`` asks; closing it early aborts the request."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # resolved against max_model_len

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    kv_events: KVEventPublisher | None  # GET /v1/kv_events; None when --enable-kv-events is off

    @property
    def config(self) -> EngineConfig: ...  # resolved: max_model_len and served_model_name are set

    @property
    def tokenizer(self) -> Any: ...  # a transformers tokenizer

    @property
    def model_path(self) -> str: ...

    @property
    def served_model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """The request's parameters over the model's defaults (--generation-config), checked:
        InvalidRequestError naming the field (server/engine/processor.py ``Processor.sampling_params``)."""
        ...

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Check the request (InvalidRequestError, naming the field) and queue it; its output stream
        (a pooling request's: one output, with ``RequestOutput.pooled``).
        ``lora_request``: the loaded adapter it runs with (``list_loras``), None for the base model."""
        ...

    def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` and its stream in one async generator (vLLM's ``AsyncLLM.generate``)."""
        ...

    def list_loras(self) -> list[LoRARequest]: ...  # the loaded adapters requests may name

    def lora_named(self, name: str) -> LoRARequest:
        """The loaded adapter named ``name``: InvalidRequestError (code model_not_found) if none."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter: LoRALoadError (a ValueError) with the reason, a taken name included."""
        ...

    async def remove_lora(self, lora_name: str) -> LoRARequest:
        """Unload an adapter for new requests (running ones finish with it); KeyError if unknown."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...

    async def shutdown(self, grace_seconds: float = 30.0) -> None: ...
