"""POST /tokenize and /detokenize (vLLM's extras): the server's own tokenizer and chat template."""

from __future__ import annotations

from pagedserve.common.errors import APIError
from pagedserve.server.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedserve.server.api.serving_base import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def create_tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = await self.apply_chat_template(request)
        else:
            text = request.prompt
        ids = await self.tokenize(text, request.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in request.tokens):
            raise APIError(f"tokens must be token ids in [0, {vocab}).", 400, param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
