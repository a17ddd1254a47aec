"""What the engine raises: a request it refuses, a step that failed, a loop that is gone.

``InvalidRequestError`` is the only error a caller's input can cause. It is a ValueError (the offline
``LLM`` lets it raise as one) that names the offending field in ``param`` and, where OpenAI has one,
its error ``code``; server/api/serving_base.py turns it into an OpenAI 400 in exactly one place.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will not run: a bad prompt, parameter or limit."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class StepError(RuntimeError):
    """A forward pass failed; the requests in that batch were aborted, the engine goes on."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} requests: {cause!r}")
        self.request_ids = request_ids


class EngineDeadError(RuntimeError):
    """The engine loop is not running: nothing can be added."""
