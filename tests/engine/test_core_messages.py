"""The messages between the front end and the core process cross the pipe unchanged: a step's outputs
travel as plain tuples (server/engine/core_messages.py ``StepOutputs.__reduce__``) and come back as the
same objects, every field of every kind of output included."""

from __future__ import annotations

import pickle
from dataclasses import MISSING, fields

from pagedserve.server.engine.core_messages import StepOutputs
from pagedserve.server.engine.core_output import EngineCoreOutput, EngineStats
from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.outputs import RequestMetrics, SampledToken


def test_step_outputs_survive_the_pipe() -> None:
    token = SampledToken(7, logprob=-0.5, rank=1, top_ids=[7, 9], top_logprobs=[-0.5, -1.5])
    outputs = [
        EngineCoreOutput("plain", [5], None, None, None, 0, RequestMetrics(1.0, 2.0, 3.0, 3.0)),
        EngineCoreOutput("done", [2], None, "stop", 2, 16, RequestMetrics(1.0, 2.0, 3.0, 4.0, 4.5),
                         token_time=4.0),
        EngineCoreOutput("logprobs", [7, 8], [token, token], None, None, 0, RequestMetrics(0.5),
                         prompt_logprobs=[token]),
        EngineCoreOutput("pooled", [], None, "stop", None, 0, RequestMetrics(1.0), pooled=[0.5, 1.5]),
        EngineCoreOutput("prefilled", [3], None, "length", None, 0, RequestMetrics(1.0),
                         kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [4, 2]}),
    ]
    # Each optional field is set by one of them: a field the tuples forget fails here, not in a server.
    for declared in fields(EngineCoreOutput):
        if declared.default is not MISSING:
            assert any(getattr(o, declared.name) != declared.default for o in outputs), declared.name
    stats = EngineStats(3, 1, 0.25, 10, 4, 0, 12, 4, 100, 16)
    step = StepOutputs(outputs, stats, kv_events=[("stored", 1)], failed_ids=["gone"],
                       error=InvalidRequestError("bad", param="n"))
    back = pickle.loads(pickle.dumps(step))
    assert back.outputs == step.outputs and back.stats == step.stats
    assert back.kv_events == step.kv_events and back.failed_ids == step.failed_ids
    assert isinstance(back.error, InvalidRequestError) and str(back.error) == str(step.error)
