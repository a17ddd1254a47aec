"""The router's OpenAPI description, served at ``GET /openapi.json``.

The router's own routes are described in full. Everything under ``/v1/`` is proxied to a replica as it
is, so those routes are passthrough: any JSON body, and the replica's answer unchanged (the engine's own
``/openapi.json`` describes them). Only the router's own answers on them are spelled out (401 with
``--api-key``, 503 when no replica can serve, 504 on a read timeout), and, for the two generation
routes, the body fields the router itself reads to pick a replica (router/hashing.py): their types
there are what the router tolerates, any value is passed on for the replica to judge.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from pagedserve.common.routing import POOLING_PATHS

from pagedserve.version import __version__

ERROR = {
    "type": "object",
    "description": "OpenAI's error shape (common/errors.py).",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}

BACKEND = {
    "type": "object",
    "required": ["url", "ready", "in_flight", "load"],
    "properties": {
        "url": {"type": "string"},
        "role": {
            "enum": ["colocated", "prefill", "decode"],
            "description": "prefill or decode under --strategy pd (router/pd.py), else colocated",
        },
        "ready": {"type": "boolean", "description": "in the ring: discovered ready and healthy"},
        "discovered_ready": {"type": "boolean"},
        "healthy": {"type": "boolean"},
        "in_flight": {"type": "integer", "minimum": 0},
        "waiting": {"type": "number", "minimum": 0},
        "kv_cache_usage": {"type": "number", "minimum": 0, "maximum": 1},
        "load": {"type": "number", "minimum": 0},
        "indexed_blocks": {"type": "integer", "minimum": 0},
        "idle_connections": {"type": "integer", "minimum": 0},
    },
}

# The fields of a generation request that the router reads (router/hashing.py); the rest pass through.
ROUTED_FIELDS = {
    "messages": {"type": "array", "description": "chat messages, rendered with the chat template"},
    "prompt": {"description": "a string, token ids, or a batch of either (routed on the first)"},
    "tools": {"description": "passed to the chat template"},
    "chat_template_kwargs": {"description": "passed to the chat template"},
    "add_generation_prompt": {"description": "passed to the chat template"},
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _proxied(summary: str, body: dict[str, Any] | None) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "401": _json(ERROR, "the router's API key is set and the request does not carry it"),
            "503": _json(ERROR, "no replica could serve the request (or the last one tried answered 503)"),
            "504": _json(ERROR, "the replica sent nothing for --read-timeout seconds"),
            "default": {"description": "the replica's answer, passed through unchanged"},
        },
    }
    if body is not None:
        operation["requestBody"] = {
            "required": False,
            "content": {"application/json": {"schema": body}},
        }
    return operation


def _generation(summary: str) -> dict[str, Any]:
    body = {"type": "object", "properties": ROUTED_FIELDS, "additionalProperties": True}
    return {"post": _proxied(summary + " Routed by the prompt's cached prefix.", body)}


@cache
def openapi_json() -> bytes:
    passthrough_param = {"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "pagedserve router",
            "version": __version__,
            "description": __doc__.strip(),
        },
        "paths": {
            "/v1/chat/completions": _generation("Chat completion, proxied to a replica."),
            "/v1/completions": _generation("Completion, proxied to a replica."),
            "/v1/{path}": {
                "parameters": [passthrough_param],
                "get": _proxied("Any other /v1 route, proxied to a replica.", None),
                "post": _proxied("Any other /v1 route, proxied to a replica.", {}),
            },
            **{path: {"post": _proxied("vLLM's pooling route, proxied to a replica.", {})}
               for path in POOLING_PATHS},
            "/health": {
                "get": {
                    "summary": "The router's liveness.",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["status", "ready_backends", "backends"],
                                "properties": {
                                    "status": {"const": "ok"},
                                    "ready_backends": {"type": "integer", "minimum": 0},
                                    "backends": {"type": "integer", "minimum": 0},
                                    # --strategy pd: the prefill engines (the others are the decode ones)
                                    "ready_prefill_backends": {"type": "integer", "minimum": 0},
                                    "prefill_backends": {"type": "integer", "minimum": 0},
                                },
                            },
                            "alive",
                        )
                    },
                }
            },
            "/ready": {
                "get": {
                    "summary": "Ready once a replica is.",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["status", "ready_backends"],
                                "properties": {
                                    "status": {"const": "ok"},
                                    "ready_backends": {"type": "integer", "minimum": 1},
                                },
                            },
                            "at least one replica is ready",
                        ),
                        "503": _json(ERROR, "no replica is ready"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "The router's Prometheus metrics (pagedserve_router_*).",
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/backends": {
                "get": {
                    "summary": "Each replica's state, as the balancer sees it.",
                    "responses": {"200": _json({"type": "array", "items": BACKEND}, "the replicas")},
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "responses": {"200": _json({"type": "object"}, "the OpenAPI description")},
                }
            },
        },
    }
    return json.dumps(doc).encode()
