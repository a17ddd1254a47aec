"""What the engine raises: a request it refuses, a step that failed, a loop that is gone.

``InvalidRequestError`` is the only error a caller's input can cause. It is a ValueError (the offline
``LLM`` lets it raise as one) that names the offending field in ``param`` and, where OpenAI has one,
its error ``code``; server/api/serving_base.py turns it into an OpenAI 400 in exactly one place.
"""

from __future__ import annotations

from typing import Any


class InvalidRequestError(ValueError):
    """A request the engine will not run: a bad prompt, parameter or limit."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class StepError(RuntimeError):
    """A step failed for ``request_ids``; those were aborted, the engine goes on.

    A failed forward pass fails its whole batch; a request whose token alone could not be sampled fails
    alone, and ``outputs`` then holds what the step's other requests gained (the core's
    EngineCoreOutputs, or the RequestOutputs made from them by server/engine/llm_engine.py).
    """

    def __init__(
        self, request_ids: list[str], cause: BaseException, outputs: list[Any] | None = None
    ) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} requests: {cause!r}")
        self.request_ids = request_ids
        self.outputs = outputs or []


class EngineDeadError(RuntimeError):
    """The engine loop is not running: nothing can be added."""


class RankDiedError(EngineDeadError):
    """A tensor-parallel rank died (server/executor/tp_driver.py): no step can run again, the server
    exits."""
