"""The output processor alone, with a one-character-per-token tokenizer: stop strings, n > 1, and core
outputs that arrive for a sample after its stop string (the abort was still on its way)."""

from __future__ import annotations

from pagedserve.server.engine.core_output import EngineCoreOutput
from pagedserve.server.engine.output_processor import OutputProcessor
from pagedserve.server.engine.processor import Processor
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.sampling_params import RequestOutputKind, SamplingParams


class CharTokenizer:
    """Token id = character code."""

    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def token(request_id: str, char: str, finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [ord(char)], None, finish, None, 0, RequestMetrics(0.0))


def test_stop_string_ends_one_sample_and_later_tokens_are_ignored() -> None:
    tokenizer = CharTokenizer()
    processor = Processor(
        tokenizer, vocab_size=256, max_model_len=64, max_num_seqs=4, eos_token_ids=frozenset()
    )
    outputs = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=10, stop=["cd"], output_kind=RequestOutputKind.DELTA)
    outputs.add_request(processor.process("r", "ab", params))

    shown: dict[int, str] = {0: "", 1: ""}
    steps = [("c", "x"), ("d", "y"), ("e", "z")]  # sample 0 writes "cd" (a stop string), then "e"
    aborted = []
    for char0, char1 in steps:
        processed = outputs.process_outputs([token("r#0", char0), token("r#1", char1)])
        aborted += processed.to_abort
        for request_output in processed.request_outputs:
            for delta in request_output.outputs:
                shown[delta.index] += delta.text
    assert aborted == ["r#0"]  # once: the core frees its blocks
    # The last character is held back while it may start a stop string: "c" was, then cut with "cd".
    assert shown == {0: "", 1: "xy"}
    state = outputs.requests["r"]
    sample0 = state.samples["r#0"]
    assert sample0.finish_reason == "stop" and sample0.stop_reason == "cd"
    assert sample0.detokenizer.output_token_ids == [ord("c"), ord("d")]  # the late "e" was dropped

    processed = outputs.process_outputs([token("r#1", "!", finish="length")])
    (final,) = processed.request_outputs
    assert final.finished and [(c.index, c.text) for c in final.outputs] == [(1, "z!")]
    assert not outputs.requests and not outputs.parent_of


def test_inter_token_latencies_come_from_the_core_and_survive_folding() -> None:
    """One gap per step with tokens, by the core's timestamps; folded deltas keep every gap (the API's
    histogram must not lose gaps when it reads late, server/engine/async_engine.py folds piled outputs)."""
    tokenizer = CharTokenizer()
    processor = Processor(tokenizer, vocab_size=256, max_model_len=64, max_num_seqs=4,
                          eos_token_ids=frozenset())
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", "ab", SamplingParams(max_tokens=8,
                                                                    output_kind=RequestOutputKind.DELTA)))
    deltas = []
    for char, at in (("x", 1.0), ("y", 1.5), ("z", 2.5)):
        step = token("r", char)
        step.token_time = at
        deltas += outputs.process_outputs([step]).request_outputs
    assert [d.inter_token_latencies for d in deltas] == [[], [0.5], [1.0]]
    folded = deltas[0]
    for later in deltas[1:]:
        folded.add(later)
    assert folded.inter_token_latencies == [0.5, 1.0]
