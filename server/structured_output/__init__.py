"""Structured outputs: a request's output constrained to a grammar (vLLM's ``structured_outputs``).

The engine is llguidance (chosen over xgrammar by ``python -m pagedserve.benchmarks.structured_outputs
--compare-backends``: a mid-size schema compiles in ~2 ms instead of ~900 ms, the per-step mask costs are
alike, its own limits bound pathological grammars, and it refuses the JSON-schema keywords it cannot
enforce instead of dropping them). One concept per file:

- ``grammar.py``: a ``StructuredOutputsParams`` as llguidance grammar text, and its cache key;
- ``compiler.py``: compile once per distinct key (bounded LRU), in bounded time, refusing bad specs with
  ``InvalidRequestError`` (server/engine/processor.py calls it before a request is queued);
- ``matcher.py``: one request's position in its grammar (``Request.grammar``), advanced by
  server/engine/core.py with each accepted token;
- ``bitmask.py``: the step's token bitmask, filled by server/worker/model_runner.py while the forward
  pass runs and applied first by server/sample/sampler.py.
"""
