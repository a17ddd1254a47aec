"""Compiles each distinct constraint once, in bounded time, and refuses the ones that cannot be enforced.

``GrammarCompiler.compile`` runs in server/engine/processor.py, before a request is queued, so a bad
schema, an unsupported keyword (llguidance refuses what it cannot enforce rather than ignoring it), a
regex that is not one or an unknown grammar rule is an ``InvalidRequestError`` naming
``structured_outputs.<kind>``, and nothing reaches the engine core.

Compiling builds an llguidance matcher and its first token mask (the lexer's start state: a grammar
whose lexer blows up fails here, not in a step). llguidance bounds its own work (``LLParserLimits``: lexer
fuel, Earley items, grammar size) yet some grammars still take seconds to refuse, so the compile runs on
a worker thread (llguidance drops the GIL) and a caller waits at most ``timeout_s``: past that the request
is refused and the worker finishes within the library's limits, its result discarded.

The result, a prototype matcher, is cached by ``GrammarKey`` (kind, spec text, whitespace options) in a
bounded LRU; each request (each of n samples) gets its own copy of it (``CompiledGrammar.new_state``).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from pagedserve.server.grammar_state import GrammarState
from pagedserve.server.sampling_params import StructuredOutputsParams, ThinkGate
from pagedserve.server.structured_output.grammar import GrammarKey, grammar_key, grammar_source

COMPILE_TIMEOUT_S = 5.0
CACHE_SIZE = 256  # distinct constraints kept compiled
COMPILE_WORKERS = 2  # a compile past its deadline holds a worker until llguidance's limits stop it


@dataclass(frozen=True)
class CompiledGrammar:
    key: GrammarKey
    prototype: Any  # llguidance.LLMatcher at the grammar's start, never advanced itself
    vocab_size: int
    eos_token_ids: frozenset[int]

    def new_state(self, gate: ThinkGate | None = None) -> GrammarState:
        """A matcher of its own for one request, at the start of the grammar (after the reasoning, with a
        reasoning model's ``gate``)."""
        return GrammarState(self.prototype.deep_copy(), self.vocab_size, self.eos_token_ids, gate=gate)


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        import llguidance.hf

        # The matcher allows these ids once the grammar is satisfied; the engine ends the request there.
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids))
        self.special_tokens = frozenset(getattr(tokenizer, "all_special_tokens", ()))
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout_s = timeout_s
        self._workers = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="grammar-compile")
        self._cached = functools.lru_cache(maxsize=cache_size)(self._compile_bounded)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint's compiled grammar (cached); InvalidRequestError when it cannot be enforced."""
        return self._cached(grammar_key(params))

    def cache_info(self) -> Any:
        return self._cached.cache_info()

    def _compile_bounded(self, key: GrammarKey) -> CompiledGrammar:
        future = self._workers.submit(self._compile, key)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            problem = f"the grammar did not compile within {self.timeout_s:g} s; simplify it"
            raise key.invalid(problem) from None

    def _compile(self, key: GrammarKey) -> CompiledGrammar:
        import llguidance

        source = grammar_source(key, self.special_tokens)
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the start state's mask: lexer limits are hit here or not at all yet
        if matcher.is_error():
            raise key.invalid(matcher.get_error())
        return CompiledGrammar(key, matcher, self.vocab_size, self.eos_token_ids)
