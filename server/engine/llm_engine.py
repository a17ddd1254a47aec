"""The synchronous engine: the core and its front end on one thread, for the offline ``LLM``.

``add_request`` checks a request (server/engine/processor.py) and queues its samples in the core
(server/engine/core.py); ``step`` runs one core step and hands its token ids straight to the output
processor (server/engine/output_processor.py), which makes the text and the RequestOutputs.
"""

from __future__ import annotations

from pagedserve.server.config import EngineConfig
from pagedserve.server.engine.core import EngineCore
from pagedserve.server.engine.core_client import CoreProcessClient, make_core
from pagedserve.server.engine.core_output import EngineCoreOutput, EngineStats
from pagedserve.server.engine.gc_heap import freeze_startup_heap
from pagedserve.server.engine.output_processor import OutputProcessor
from pagedserve.server.engine.processor import ProcessedRequest, PromptInput, load_tokenizer, make_processor
from pagedserve.server.exceptions import StepError
from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.outputs import RequestOutput
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, core_process: bool = False) -> None:
        """``core_process``: the core in a process of its own (server/engine/core_client.py), its steps
        overlapping this process's output processing; else it steps here, on the caller's thread."""
        self.core: EngineCore | CoreProcessClient = make_core(config, core_process)
        self.config = config
        self.tokenizer = load_tokenizer(config, self.core)
        self.processor = make_processor(self.core, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        freeze_startup_heap()

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    def process_inputs(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                       arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Check one request (raises InvalidRequestError, a ValueError); queues nothing."""
        return self.processor.process(request_id, prompt, params, arrival_time, lora_request)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read, check and register an adapter; LoRALoadError (a ValueError) with the reason."""
        with self.processor.registering_lora(lora_request):
            self.core.add_lora(lora_request, self.core.load_lora(lora_request))

    def remove_lora(self, lora_name: str) -> None:
        """KeyError for an unknown name; requests already running finish with it."""
        self.core.remove_lora(self.processor.unregister_lora(lora_name).lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.processor.lora_requests.values())

    def add(self, request: ProcessedRequest) -> None:
        self.output_processor.add_request(request)
        for child in request.children:
            self.core.add_request(child)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        self.add(self.process_inputs(request_id, prompt, params, arrival_time, lora_request))

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks' processes (also done at exit)."""
        self.core.shutdown()

    def step(self) -> list[RequestOutput]:
        """One core step; the outputs of the requests it advanced (as each one's output_kind asks)."""
        try:
            core_outputs = self.core.step()
        except StepError as exc:
            raise self._fail(exc) from exc.__cause__
        finally:
            # KV events (enable_kv_events) are published by the server only: offline, none piles up.
            self.core.take_kv_events()
        return self._process(core_outputs)

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(core_outputs)
        self.core.abort_requests(processed.to_abort)
        return processed.request_outputs

    def _fail(self, exc: StepError) -> StepError:
        """The core aborted these samples; abort their requests whole and name those. The step's other
        requests' outputs are processed still and travel with the error."""
        outputs = self._process(exc.outputs)
        request_ids = self.output_processor.requests_of(exc.request_ids)
        for request_id in request_ids:
            self.abort_request(request_id)
        return StepError(request_ids, exc.__cause__ or exc, outputs)

    def stats(self) -> EngineStats:
        return self.core.stats()
