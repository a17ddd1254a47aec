"""The front end's vLLM detokenizer options: stop strings wait for min_tokens, and
spaces_between_special_tokens (checked with a WordPiece tokenizer, whose decoder puts a space between
tokens; the embedded model's byte-level one never does, so the option cannot change its text)."""

from __future__ import annotations

import pytest
from pagedserve.server.engine.core_output import EngineCoreOutput
from pagedserve.server.engine.output_processor import OutputProcessor
from pagedserve.server.engine.processor import Processor
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.sampling_params import SamplingParams

from pagedserve import LLM

WORDS = {"[UNK]": 0, "hello": 1, "world": 2, "[CLS]": 3, "[SEP]": 4}


@pytest.fixture(scope="module")
def wordpiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=WORDS, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def detokenize(tokenizer, token_ids: list[int], **params: object) -> str:
    """The text the output processor makes of these output tokens (prompt: "hello")."""
    processor = Processor(tokenizer, len(WORDS), max_model_len=64, max_num_seqs=1, eos_token_ids=frozenset())
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", {"prompt_token_ids": [1]}, SamplingParams(**params)))
    core_outputs = [EngineCoreOutput("r", [t], None, None, None, 0, RequestMetrics(0.0)) for t in token_ids]
    processed = outputs.process_outputs(core_outputs)
    return processed.request_outputs[-1].outputs[0].text


def test_spaces_between_special_tokens(wordpiece_tokenizer) -> None:
    ids = [4, 3, 2, 4, 3, 4]  # [SEP] [CLS] world [SEP] [CLS] [SEP]
    shown = {"skip_special_tokens": False, "max_tokens": 16}
    assert detokenize(wordpiece_tokenizer, ids, **shown) == " [SEP] [CLS] world [SEP] [CLS] [SEP]"
    assert (
        detokenize(wordpiece_tokenizer, ids, **shown, spaces_between_special_tokens=False)
        == " [SEP][CLS] world [SEP][CLS][SEP]"
    )
    # Hidden special tokens have no spaces between them to remove.
    for spaces in (True, False):
        assert detokenize(wordpiece_tokenizer, ids, spaces_between_special_tokens=spaces) == " world"



def test_min_tokens_holds_back_stop_strings(llm: LLM) -> None:
    """A stop string seen before min_tokens output tokens does not stop the request (vLLM's rule)."""
    prompt = "Once upon a time, in a land far away,"
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    (free,) = llm.generate(prompt, greedy)
    text, token_ids = free.outputs[0].text, free.outputs[0].token_ids
    word = text.split()[1]
    (early,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[word]))
    assert early.outputs[0].finish_reason == "stop"
    num_early = len(early.outputs[0].token_ids)
    assert num_early < 12

    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[word], min_tokens=12)
    (held,) = llm.generate(prompt, params)
    out = held.outputs[0]
    # The first occurrence did not stop it: the text runs past it, on the same greedy path.
    assert len(out.token_ids) > 12 and out.token_ids[:num_early] == token_ids[:num_early]
    assert out.text.startswith(early.outputs[0].text + word)
    # A stop string that only appears after min_tokens still stops it (and is cut from the text).
    if out.finish_reason == "stop":
        assert out.stop_reason == word and not out.text.endswith(word)
    else:
        assert out.finish_reason == "length" and out.token_ids == token_ids


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_fast_decode_is_the_tokenizers_decode(llm: LLM, wordpiece_tokenizer, clean_up: bool) -> None:
    """``text_decoder`` calls the Rust tokenizer directly where transformers would only pass the call on;
    its text is ``tokenizer.decode``'s for any ids, special ones included, either skip setting."""
    import random

    from pagedserve.server.engine.detokenizer import text_decoder

    rng = random.Random(0)
    for tokenizer in (llm.get_tokenizer(), wordpiece_tokenizer):
        was = tokenizer.clean_up_tokenization_spaces
        tokenizer.clean_up_tokenization_spaces = clean_up  # the fixtures are shared: set back below
        try:
            decode = text_decoder(tokenizer)
            specials = list(tokenizer.all_special_ids)
            for _ in range(200):
                ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(tokenizer))
                       for _ in range(rng.randrange(1, 8))]
                for skip in (False, True):
                    assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
        finally:
            tokenizer.clean_up_tokenization_spaces = was
