"""The pooling runner's endpoints: OpenAI's POST /v1/embeddings, vLLM's /pooling, /score and /rerank.

Every input becomes one engine request with ``PoolingParams`` (server/pooling_params.py); the engine's
processor refuses them on a generating model, and generation on a pooling one, so each endpoint answers a
400 naming the runner rather than a wrong result. Scores are the cosine similarity of the two texts'
embeddings (server/scoring.py), as vLLM scores with an embedding model. An embedding as ``base64`` is its
little-endian float32 bytes, what the openai client asks for by default and decodes.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from pagedserve.server.api.protocol import (
    EmbeddingRequest,
    PoolingInput,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedserve.server.api.serving_base import OpenAIServing, random_id
from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.outputs import RequestOutput
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.scoring import cosine_similarity, score_pairs
from starlette.requests import Request


class OpenAIServingPooling(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> dict[str, Any]:
        return await self._vectors(request, raw_request, "embd", "embedding", "embedding")

    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> dict[str, Any]:
        return await self._vectors(request, raw_request, "pool", "pooling", "data")

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> dict[str, Any]:
        firsts, seconds = _as_list(request.text_1), _as_list(request.text_2)
        try:
            pairs = score_pairs(range(len(firsts)), range(len(seconds)))
        except InvalidRequestError as exc:
            raise self.invalid_request(exc, "text_1") from exc
        lora = self.check_model(request.model)
        outputs = await self._pool(firsts + seconds, PoolingParams(), request, raw_request, lora, "text_1")
        data = [
            {"index": index, "object": "score",
             "score": cosine_similarity(outputs[i].pooled or [], outputs[len(firsts) + j].pooled or [])}
            for index, (i, j) in enumerate(pairs)
        ]  # fmt: skip
        return {**self._envelope("score", lora), "data": data, "usage": _usage(outputs)}

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> dict[str, Any]:
        lora = self.check_model(request.model)
        if not request.documents:
            return {"id": f"rerank-{random_id()}", "model": self.response_model(lora), "results": [],
                    "usage": {"total_tokens": 0}}  # fmt: skip
        outputs = await self._pool([request.query, *request.documents], PoolingParams(), request,
                                   raw_request, lora, "documents")
        query = outputs[0].pooled or []
        results = [
            {"index": index, "relevance_score": cosine_similarity(query, output.pooled or []),
             **({"document": {"text": text}} if request.return_documents else {})}
            for index, (text, output) in enumerate(zip(request.documents, outputs[1:], strict=True))
        ]  # fmt: skip
        results.sort(key=lambda result: -result["relevance_score"])
        if request.top_n:
            results = results[: request.top_n]
        usage = _usage(outputs)
        return {"id": f"rerank-{random_id()}", "model": self.response_model(lora), "results": results,
                "usage": {"total_tokens": usage["total_tokens"]}}  # fmt: skip

    # ---- shared --------------------------------------------------------------------------------------

    async def _vectors(self, request: EmbeddingRequest, raw_request: Request, id_prefix: str,
                       object_name: str, key: str) -> dict[str, Any]:
        """/v1/embeddings and /pooling: one vector per input, as floats or base64."""
        lora = self.check_model(request.model)
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        outputs = await self._pool(_inputs(request.input), params, request, raw_request, lora, "input")
        encoding = request.encoding_format
        data = [
            {"index": index, "object": object_name, key: _encoded(output.pooled or [], encoding)}
            for index, output in enumerate(outputs)
        ]
        return {**self._envelope(id_prefix, lora), "data": data, "usage": _usage(outputs)}

    def _envelope(self, id_prefix: str, lora: LoRARequest | None) -> dict[str, Any]:
        return {"id": f"{id_prefix}-{random_id()}", "object": "list", "created": int(time.time()),
                "model": self.response_model(lora)}  # fmt: skip

    async def _pool(self, inputs: list[str | list[int]], params: PoolingParams, request: Any,
                    raw_request: Request, lora: LoRARequest | None, input_param: str) -> list[RequestOutput]:
        """Each input pooled by the engine, concurrently; a refused input is a 400 naming ``input_param``."""
        self.check_serving()
        if not inputs:
            raise self.invalid_request(InvalidRequestError("The input must not be empty.", param="prompt"),
                                       input_param)
        truncate = request.truncate_prompt_tokens
        if truncate == -1:
            truncate = self.max_model_len
        prompts = []
        for item in inputs:
            if isinstance(item, str):
                ids = await self.tokenize(item, request.add_special_tokens, truncate)
            else:
                ids = item[-truncate:] if truncate else list(item)
            prompts.append({"prompt_token_ids": ids})
        streams = await self.add_requests(prompts, params, input_param, request, lora)
        observed = [self.observed(s, self.metrics.track(len(s.prompt_token_ids), 0, 1)) for s in streams]
        return await self.final_outputs(raw_request, observed)


def _inputs(value: PoolingInput) -> list[str | list[int]]:
    """OpenAI's ``input`` forms as a list of prompts: a text, texts, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(item, int) for item in value):
        return [list(value)]  # type: ignore[arg-type]  # one prompt of token ids
    return list(value)  # type: ignore[arg-type]


def _as_list(value: str | list[str]) -> list[str | list[int]]:
    return [value] if isinstance(value, str) else list(value)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}
