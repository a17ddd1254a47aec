"""Structured outputs: what a grammar costs. ``python -m pagedserve.benchmarks.structured_outputs``.

Default mode: output tok/s of the embedded model with a JSON schema (:data:`MID_SCHEMA`) on every request
against the same workload unconstrained, at 1 and 32 concurrent requests, side by side in one run, with
the ratio. Concurrency is the engine's ``max_num_seqs``, every prompt queued at once (``LLM.generate``).
Both runs are greedy over the same prompts; the constrained run goes first and each unconstrained
request then generates exactly as many tokens as its constrained twin did (``ignore_eos``), so both runs
have the same batches step for step and the ratio is the grammar's cost alone: filling the bitmask,
applying it, advancing the matchers. Timed: the ``generate`` calls only, alternated, best of
``--repeats`` each, after a short warm-up that compiles the schema (what compiling costs is what
``--compare-backends`` measures).

``--compare-backends``: the two maintained grammar engines, xgrammar and llguidance, on the embedded
model's tokenizer, without the model: compile time of :data:`MID_SCHEMA` (15 properties, nested objects,
``$defs``/``$ref``, enums, arrays; a fresh compiler each time, no cache), then the per-step token-mask
fill while a valid instance of it is walked token by token, at batch 1 and at batch 64 (64 matchers at
staggered positions; one row each, serially, and through the library's own parallel batch call). This
picked the engine server/structured_output/ uses; the other one only needs installing for this mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

MID_SCHEMA: dict[str, Any] = {
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "FR", "DE", "JP"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "contact": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["email", "phone"]},
                "value": {"type": "string", "maxLength": 40},
            },
            "required": ["kind", "value"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "minLength": 1, "maxLength": 60},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "home": {"$ref": "#/$defs/address"},
        "work": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
        "contacts": {"type": "array", "items": {"$ref": "#/$defs/contact"}, "minItems": 1, "maxItems": 3},
        "created": {"type": "string", "format": "date"},
        "manager_id": {"type": ["integer", "null"]},
        "notes": {"type": "string"},
        "metrics": {
            "type": "object",
            "properties": {"visits": {"type": "integer"}, "ratio": {"type": "number"}},
            "required": ["visits"],
        },
        "version": {"const": 2},
    },
    "required": ["id", "name", "age", "active", "role", "home", "contacts", "version"],
    "additionalProperties": False,
}

MID_INSTANCE: dict[str, Any] = {
    "id": 17,
    "name": "Ada Lovelace",
    "age": 36,
    "score": 0.93,
    "active": True,
    "role": "editor",
    "tags": ["math", "engines"],
    "home": {"street": "12 St James's Square", "city": "London", "zip": "10001", "country": "US"},
    "work": None,
    "contacts": [{"kind": "email", "value": "ada@example.org"}],
    "created": "1843-07-10",
    "manager_id": None,
    "notes": "Wrote the first program for the Analytical Engine.",
    "metrics": {"visits": 12, "ratio": 0.5},
    "version": 2,
}


# ---- --compare-backends ------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema: str) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)  # cold: no cached grammar
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: str) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)  # builds the lexer and parser tables
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, rows: int) -> Any:
        return self.llt.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


def compare_backends(model_path: str, repeats: int, batch: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    vocab_size = len(tokenizer)
    schema = json.dumps(MID_SCHEMA)
    tokens = tokenizer.encode(json.dumps(MID_INSTANCE, separators=(",", ":")), add_special_tokens=False)
    tokens.append(int(tokenizer.eos_token_id))
    results: dict[str, Any] = {"instance_tokens": len(tokens), "batch": batch}
    for backend_type in (_Xgrammar, _Llguidance):
        try:
            backend, setup_s = _timed(lambda t=backend_type: t(tokenizer, vocab_size))
        except ImportError as exc:
            print(f"{backend_type.name}: not installed ({exc}); pip install {backend_type.name}")
            continue
        compile_s = [_timed(lambda b=backend: b.compile(schema))[1] for _ in range(max(repeats, 3))]
        compiled = backend.compile(schema)
        results[backend.name] = {
            "tokenizer_setup_ms": setup_s * 1e3,
            "compile_ms_median": statistics.median(compile_s) * 1e3,
            "compile_ms_first": compile_s[0] * 1e3,
            **_mask_costs(backend, compiled, tokens, batch),
        }
    return results


def _mask_costs(backend: Any, compiled: Any, tokens: list[int], batch: int) -> dict[str, float]:
    """Per-step fill of one matcher walking ``tokens``; then ``batch`` matchers at staggered positions."""
    one = backend.matcher(compiled)
    bitmask = backend.bitmask(1)
    fills = []
    for token in tokens:
        fills.append(_timed(lambda m=one: backend.fill(m, bitmask, 0))[1])
        if not backend.accept(one, token):
            raise RuntimeError(f"{backend.name} rejected token {token} of a valid instance")
    matchers = [backend.matcher(compiled) for _ in range(batch)]
    for index, matcher in enumerate(matchers):  # row i starts i tokens in: different states per row
        for token in tokens[: index % (len(tokens) - 1)]:
            backend.accept(matcher, token)
    big = backend.bitmask(batch)
    serial, parallel = [], []
    for _ in range(8):
        serial.append(_timed(lambda: [backend.fill(m, big, i) for i, m in enumerate(matchers)])[1])
        parallel.append(_timed(lambda: backend.fill_batch(matchers, big))[1])
    return {
        "fill_b1_us_mean": statistics.mean(fills) * 1e6,
        "fill_b1_us_p99": sorted(fills)[int(0.99 * (len(fills) - 1))] * 1e6,
        f"fill_b{batch}_serial_ms": statistics.median(serial) * 1e3,
        f"fill_b{batch}_batch_call_ms": statistics.median(parallel) * 1e3,
    }


def print_backends(results: dict[str, Any]) -> None:
    batch = results["batch"]
    print(
        f"mid-size schema ({len(MID_SCHEMA['properties'])} properties), instance of "
        f"{results['instance_tokens']} tokens"
    )
    header = (
        f"{'backend':<11} {'tokenizer':>10} {'compile':>9} {'compile1':>9} {'fill b1':>9} "
        f"{'b1 p99':>8} {f'b{batch} serial':>11} {f'b{batch} batch':>10}"
    )
    print(header)
    for name in ("xgrammar", "llguidance"):
        if name not in results:
            continue
        r = results[name]
        print(
            f"{name:<11} {r['tokenizer_setup_ms']:>8.0f}ms {r['compile_ms_median']:>7.1f}ms "
            f"{r['compile_ms_first']:>7.1f}ms {r['fill_b1_us_mean']:>7.0f}us {r['fill_b1_us_p99']:>6.0f}us "
            f"{r[f'fill_b{batch}_serial_ms']:>9.2f}ms {r[f'fill_b{batch}_batch_call_ms']:>8.2f}ms"
        )


# ---- constrained vs unconstrained throughput ----------------------------------------------------------


def throughput(model_path: str, concurrency: int, num_prompts: int, max_tokens: int, repeats: int) -> dict:
    from pagedserve.server.sampling_params import StructuredOutputsParams

    from pagedserve import LLM, SamplingParams

    llm = LLM(model_path, max_num_seqs=concurrency)
    prompts = [
        f"Record {i}: write the JSON profile of a fictional employee, id {i}." for i in range(num_prompts)
    ]
    schema = StructuredOutputsParams(json=MID_SCHEMA)
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=schema)
    ] * num_prompts
    # Warm-up, not timed: the model's first steps, the schema's compile and its first lexer states.
    llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=schema))
    outputs, elapsed = _timed(lambda: llm.generate(prompts, constrained))
    constrained_s, free_s = [elapsed], []
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    for repeat in range(repeats):  # alternated, best-of: the machine's other load hits both alike
        if repeat:
            constrained_s.append(_timed(lambda: llm.generate(prompts, constrained))[1])
        free_outputs, elapsed = _timed(lambda: llm.generate(prompts, free))
        free_s.append(elapsed)
        assert [len(o.outputs[0].token_ids) for o in free_outputs] == lengths
    tokens = sum(lengths)
    return {
        "concurrency": concurrency,
        "num_prompts": num_prompts,
        "output_tokens": tokens,
        "json_valid": sum(_parses(o.outputs[0].text) for o in outputs),
        "constrained_tok_s": tokens / min(constrained_s),
        "unconstrained_tok_s": tokens / min(free_s),
        "ratio": min(free_s) / min(constrained_s),
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def print_throughput(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'concurrency':>11} {'requests':>8} {'out tokens':>10} {'valid JSON':>10} "
        f"{'json_schema tok/s':>17} {'unconstrained tok/s':>19} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>11} {r['num_prompts']:>8} {r['output_tokens']:>10} "
            f"{r['json_valid']:>6}/{r['num_prompts']:<3} {r['constrained_tok_s']:>17.1f} "
            f"{r['unconstrained_tok_s']:>19.1f} {r['ratio']:>6.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--compare-backends", action="store_true", help="xgrammar vs llguidance, no model")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each kind (best kept)")
    parser.add_argument("--batch", type=int, default=64, help="rows of the batched mask fill")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated max_num_seqs to measure")
    parser.add_argument("--requests-per-slot", type=int, default=1, help="prompts = this x concurrency")
    parser.add_argument("--max-tokens", type=int, default=128, help="output bound of every request")
    parser.add_argument("--result-json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.model is None:
        from pagedserve import default_model

        args.model = str(default_model())
    if args.compare_backends:
        results = compare_backends(args.model, args.repeats, args.batch)
        print_backends(results)
    else:
        rows = []
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            num_prompts = max(concurrency * args.requests_per_slot, 2)
            rows.append(throughput(args.model, concurrency, num_prompts, args.max_tokens, args.repeats))
            print_throughput(rows[-1:])
            sys.stdout.flush()
        print()
        print_throughput(rows)
        results = {"rows": rows}
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
