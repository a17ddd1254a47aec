"""Prefill/decode disaggregation (``--strategy pd``), the pure part: which requests it applies to, and the
bodies of its two steps. The I/O is router/proxy.py's (``RouterApp._prefill``).

Why: a long prompt's prefill is one big compute-bound pass, while decoding is many small memory-bound ones;
on one engine each stalls the other (a 30k-token prefill holds every running stream's next token). With
two pools, prefill engines only prefill and decode engines only decode, and the KV blocks move between
them. The contract is vLLM's NIXL/Mooncake connector flow, so the same router drives either engine:

1. Prefill step: the client's body to a prefill engine (chosen by prefix hash over the prefill pool, so
   shared prefixes meet the same prefill cache), with ``kv_transfer_params: {do_remote_decode: true,
   do_remote_prefill: false}``, one token (``max_tokens: 1``; chat's ``max_completion_tokens`` too when
   the client set it), not streamed, ``n: 1``. Its JSON answer carries a top-level ``kv_transfer_params``
   object saying where the blocks wait (``remote_block_ids``, ``remote_host``, ...).
2. Decode step: the client's own body, byte for byte, plus that ``kv_transfer_params``, to a decode
   engine (least load over the decode pool), through the proxy's usual forwarding: streaming, retries
   before the first byte, a client leaving cancels.

A failed prefill step is never the client's error: the original body runs colocated on a decode engine
and ``pagedserve_router_pd_fallbacks_total{reason}`` says why (``FALLBACK_REASONS``). Only a 4xx
other than 408/429 (the request itself is bad, and a decode engine would refuse it too) is the answer.
Requests P/D does not fit (``applies``) go straight to the decode pool.
"""

from __future__ import annotations

import json
from typing import Any

PD = "pd"  # the router's strategy name (router/cli.py); not an operator strategy: it deploys no prefill pool

PD_PATHS = ("/v1/chat/completions", "/v1/completions")

# pagedserve_router_pd_fallbacks_total's reasons: why a request ran colocated on a decode engine.
PREFILL_UNREACHABLE = "prefill_unreachable"  # refused, or dropped before answering
PREFILL_ERROR = "prefill_error"  # 5xx, 408/429, a timeout, or an unreadable answer
NO_KV_PARAMS = "no_kv_params"  # a 2xx without a kv_transfer_params object (the engine kept no KV)
NO_PREFILL_BACKEND = "no_prefill_backend"  # no ready prefill replica (for the request's model)
FALLBACK_REASONS = (PREFILL_UNREACHABLE, PREFILL_ERROR, NO_KV_PARAMS, NO_PREFILL_BACKEND)

# 4xx that say the prefill engine is busy or slow, not that the request is bad: fall back.
_RETRYABLE_4XX = (408, 429)

_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def applies(method: str, path: str, request: Any) -> bool:
    """True when a request can be disaggregated: a generation of one sequence whose output is tokens
    generated after the prompt. Not: several choices (``n``, ``best_of``) or several prompts in one
    completion request (one answer carries one ``kv_transfer_params``: one sequence's blocks), ``echo``
    and ``prompt_logprobs`` (outputs of the prompt's own pass, which the decode engine does not run), or
    a body that already carries ``kv_transfer_params`` (a client, or another router, driving the transfer
    itself)."""
    if method != "POST" or path not in PD_PATHS or not isinstance(request, dict):
        return False
    if "kv_transfer_params" in request or request.get("echo") or request.get("prompt_logprobs") is not None:
        return False
    if path == "/v1/completions" and not _one_prompt(request.get("prompt")):
        return False
    return request.get("n") in (None, 1) and request.get("best_of") in (None, 1)


def _one_prompt(prompt: Any) -> bool:
    """A completion's ``prompt`` names one prompt: a string, token ids, or a list of one of those."""
    if not isinstance(prompt, list) or all(isinstance(token, int) for token in prompt):
        return True
    return len(prompt) == 1


def prefill_body(path: str, request: dict[str, Any]) -> bytes:
    """The prefill step's body: the client's, asking for one token, unstreamed, with its KV held for a
    remote decode. ``min_tokens`` goes: above one it would contradict ``max_tokens`` 1 (a 400), and it
    changes no logit of the first token but EOS's, which the decode engine's own first token redoes."""
    body = dict(request)
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    body.update(kv_transfer_params=dict(_PREFILL_PARAMS), max_tokens=1, stream=False, n=1)
    if path == "/v1/chat/completions" and "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return json.dumps(body).encode()


def decode_body(body: bytes, params: dict[str, Any]) -> bytes:
    """The client's body as it came, with ``kv_transfer_params`` added as its last member (``applies``
    made sure it has none). Spliced, not re-encoded: the engine reads exactly what the client sent."""
    head = body.rstrip()
    assert head.endswith(b"}"), "applies() admits JSON objects only"
    inner = head[:-1].rstrip()
    separator = b"" if inner.endswith(b"{") else b", "
    return inner + separator + b'"kv_transfer_params": ' + json.dumps(params).encode() + b"}"


def kv_params_of(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` object of a prefill engine's JSON answer; None when it has none (null,
    absent, not an object, or the answer is not a JSON object)."""
    try:
        parsed = json.loads(answer)
    except (ValueError, RecursionError):
        return None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) else None


def is_client_error(status: int) -> bool:
    """A prefill answer to pass to the client as it is: the request is bad, the decode engine would say
    so too."""
    return 400 <= status < 500 and status not in _RETRYABLE_4XX
