"""Offline API with vLLM's names: ``LLM(model).generate(prompts, sampling_params)`` and ``.chat``; under
the pooling runner ``.embed(prompts)`` and ``.score(text_1, text_2)``."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Sequence
from typing import Any

from pagedserve.common.engine_args import keyword_parameters
from pagedserve.server.config import EngineConfig
from pagedserve.server.engine.llm_engine import LLMEngine
from pagedserve.server.engine.processor import PromptInput
from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.server.scoring import cosine_similarity, score_pairs
from tqdm.auto import tqdm

Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, core_process: bool = False, **engine_args: Any) -> None:
        """``engine_args``: the engine settings (common/engine_args.py, which this signature lists).
        ``core_process``: run the engine core in a process of
        its own, as the server does (server/engine/core_client.py); ``shutdown`` (or the interpreter's
        exit) stops it. The process is spawned, so a script using it needs the
        ``if __name__ == "__main__":`` guard, as with vLLM."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), core_process)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """With several ranks (tensor or pipeline parallelism): stop the other ranks' processes now, not at
        exit."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given none: the model's generation_config.json values (vLLM's)."""
        return self.engine.processor.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """All prompts are queued at once and run to completion with continuous batching.

        Returns one RequestOutput per prompt, in input order. Raises ValueError (InvalidRequestError,
        naming the field) for an invalid prompt or parameter before anything runs. Each request asks
        for FINAL_ONLY outputs: one RequestOutput at its end, nothing built per step. ``lora_request``:
        one adapter for every prompt or one per prompt (None: the base model), loaded on first use
        (vLLM's; needs ``enable_lora``); a bad adapter raises LoRALoadError (a ValueError).
        """
        prompt_list = _as_prompt_list(prompts)
        loras = self._lora_requests(lora_request, len(prompt_list))
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("sampling_params must be one per prompt")
        final_only: dict[int, SamplingParams] = {}
        for params in params_list:
            if id(params) not in final_only:
                final_only[id(params)] = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        parents = [
            self.engine.process_inputs(str(next(self._ids)), prompt, final_only[id(params)], None, lora)
            for prompt, params, lora in zip(prompt_list, params_list, loras, strict=False)
        ]
        for parent in parents:
            self.engine.add(parent)
        return self._run([p.request_id for p in parents], use_tqdm)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (the pooling runner; vLLM's ``LLM.embed``)."""
        prompt_list = _as_prompt_list(prompts)
        loras = self._lora_requests(lora_request, len(prompt_list))
        params = pooling_params or PoolingParams()
        parents = [
            self.engine.process_inputs(str(next(self._ids)), prompt, params, None, lora)
            for prompt, lora in zip(prompt_list, loras, strict=True)
        ]
        for parent in parents:
            self.engine.add(parent)
        return [
            PoolingRequestOutput(o.request_id, EmbeddingOutput(o.pooled or []), o.prompt_token_ids,
                                 o.finished)
            for o in self._run([p.request_id for p in parents], use_tqdm)
        ]

    def score(
        self,
        text_1: PromptInput | Sequence[PromptInput],
        text_2: PromptInput | Sequence[PromptInput],
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """The cosine similarity of each pair's embeddings (vLLM's ``LLM.score`` for an embedding model):
        one ``text_1`` against every ``text_2``, or the two lists pairwise."""
        firsts, seconds = _as_prompt_list(text_1), _as_prompt_list(text_2)
        pairs = score_pairs(range(len(firsts)), range(len(seconds)))
        embedded = self.embed(firsts + seconds, use_tqdm=use_tqdm, lora_request=lora_request)
        outputs: list[ScoringRequestOutput] = []
        for i, j in pairs:
            a, b = embedded[i], embedded[len(firsts) + j]
            score = cosine_similarity(a.outputs.embedding, b.outputs.embedding)
            outputs.append(PoolingRequestOutput(f"score-{a.request_id}-{b.request_id}", ScoringOutput(score),
                                                a.prompt_token_ids + b.prompt_token_ids))
        return outputs

    def _lora_requests(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt; the adapters not yet known are loaded now, as vLLM does."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * num_prompts
        else:
            loras = list(lora_request)
            if len(loras) != num_prompts:
                raise ValueError("lora_request must be one per prompt")
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            if lora.lora_name not in self.engine.processor.lora_requests:
                self.engine.add_lora(lora)
        return loras

    def add_lora(self, lora_request: LoRARequest) -> None:
        self.engine.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        self.engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptInput] = []
        for conversation in conversations:
            token_ids = self.engine.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
            )
            if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
                token_ids = token_ids["input_ids"]
            prompts.append({"prompt_token_ids": list(token_ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        finally:
            bar.close()
            for request_id in request_ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
        return [finished[r] for r in request_ids]


# help(LLM) and IDEs list every engine setting, from its one declaration.
LLM.__init__.__signature__ = inspect.signature(LLM.__init__).replace(  # type: ignore[attr-defined]
    parameters=[
        *list(inspect.signature(LLM.__init__).parameters.values())[:3],
        *keyword_parameters(skip=("model",)),
    ]
)


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # a single prompt given as token ids
    return list(prompts)
