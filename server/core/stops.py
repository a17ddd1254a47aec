"""A sampled token joins its request, and the stops decided on token ids (vLLM's check_stop): EOS, a
stop_token_id, a finished grammar, max_tokens, max_model_len. Text stops (stop strings) are the front
end's (server/engine/detokenizer.py).
"""

from __future__ import annotations

from pagedserve.server.request import Request, RequestStatus


def append_token(request: Request, token_id: int, now: float, max_model_len: int) -> bool:
    """Append a token (the grammar, if any, took it already) and apply the stops; True when it finished
    the request.

    A complete grammar admits only EOS; taking it ends the request with "stop", even with ignore_eos.
    max_tokens reached before that ends it with "length", its structured output cut mid-way (a JSON
    text then does not parse).
    """
    output_ids = request.output_token_ids
    if not output_ids:
        request.metrics.first_token_time = now
    request.metrics.last_token_time = now
    output_ids.append(token_id)
    if token_id in request.eos_token_ids or token_id in request.params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        if token_id in request.params.stop_token_ids:
            request.stop_reason = token_id
    elif request.grammar is not None and request.grammar.finished:
        request.status = RequestStatus.FINISHED_STOPPED
    elif len(output_ids) >= request.max_tokens or len(request.prompt_token_ids) + len(output_ids) >= (
        max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH
    else:
        return False
    request.metrics.finished_time = now
    return True
