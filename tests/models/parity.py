"""The one parity check every family's test uses: our engine's greedy tokens against HF Transformers'.

``tiny_checkpoint(config, folder)`` (pagedserve/testing/tiny_models.py) builds a seeded random-weight
model from a family's own config class (every parameter random, norms near 1), saves it with
``save_pretrained`` beside the tiny byte-level tokenizer, and returns the HF model. ``assert_greedy_parity``
then runs HF's greedy ``generate`` (eager attention, KV cache, one prompt at a time) and our ``LLM``
(batched prompts, chunked prefill through a small ``max_num_batched_tokens``, prefix caching on and hit
by a second round of prompts sharing the first round's prefixes) and asserts equal tokens and close
logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig

from pagedserve import LLM, SamplingParams
from pagedserve.testing.tiny_models import TINY, TINY_VOCAB, random_hf_model, tiny_checkpoint

__all__ = ["TINY", "TINY_VOCAB", "random_hf_model", "tiny_checkpoint"]

# The engine's backends a family is checked on: the torch references and the C++ kernels on the CPU,
# the Triton kernels on a GPU (float32 there too, against the same HF model on the CPU).
BACKENDS = [
    "torch",
    "cpu",
    pytest.param("triton", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs CUDA")]),
]
BACKEND_DEVICE = {"triton": "cuda"}


def checkpoint_fixture(cases: dict[str, Callable[[], Any]], name: str):
    """A module-scoped fixture ``name`` over ``cases`` (case name -> config factory): one
    ``(case name, HF model, checkpoint folder)`` per case, built once for the module's tests."""

    @pytest.fixture(scope="module", params=sorted(cases), name=name)
    def checkpoint(request, tmp_path_factory):
        path = tmp_path_factory.mktemp(request.param)
        return request.param, tiny_checkpoint(cases[request.param](), path), path

    return checkpoint


def shared_prefix_prompts(
    num_rounds: int = 2, per_round: int = 3, prefix_len: int = 20, seed: int = 0, lengths=(7, 19, 28)
) -> list[list[list[int]]]:
    """Rounds of prompts (byte ids); prompt ``i`` of every round starts with the same ``prefix_len`` ids,
    so later rounds hit the prefix cache the first round filled."""
    generator = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(0, 256, (prefix_len,), generator=generator).tolist() for _ in range(per_round)]
    return [
        [
            prefix + torch.randint(0, 256, (lengths[i % len(lengths)],), generator=generator).tolist()
            for i, prefix in enumerate(prefixes)
        ]
        for _ in range(num_rounds)
    ]


@dataclass
class Greedy:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], max_tokens: int) -> Greedy:
    """HF's own greedy decoding with its KV cache (what ``generate`` does), never stopping early."""
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids = torch.tensor([prompt])
    # An explicit mask: generate would otherwise mask every prompt token equal to pad_token_id.
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), dim=-1)[token])
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return Greedy(tokens, logprobs)


def llm_greedy(
    path: Path, rounds: list[list[list[int]]], max_tokens: int, backend: str, **engine_args
) -> tuple[list[list[Greedy]], int]:
    """Our engine's greedy answers to each round of prompts (one ``generate`` per round, batched), and
    how many prompt tokens the prefix cache served."""
    args = dict(
        dtype="float32",
        device=BACKEND_DEVICE.get(backend, "cpu"),
        attention_backend=backend,
        block_size=8,
        max_num_batched_tokens=16,  # prompts run in chunks
        enable_prefix_caching=True,
        kv_cache_memory_bytes=4 << 20,
    )
    llm = LLM(str(path), **{**args, **engine_args})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    answers = []
    for prompts in rounds:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        answers.append([_greedy(out.outputs[0]) for out in outputs])
    return answers, llm.engine.core.kv.prefix_hits


def _greedy(completion) -> Greedy:
    chosen = [
        entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
    return Greedy(list(completion.token_ids), chosen)


def assert_greedy_parity(
    hf,
    path: Path,
    backend: str,
    rounds: list[list[list[int]]] | None = None,
    max_tokens: int = 8,
    atol: float = 2e-3,
    **engine_args,
) -> None:
    """Our greedy tokens equal HF's for every prompt, logprobs within ``atol``, and the prefix cache was
    hit (rounds after the first share prefixes with it)."""
    rounds = rounds if rounds is not None else shared_prefix_prompts()
    ours, prefix_hits = llm_greedy(path, rounds, max_tokens, backend, **engine_args)
    assert prefix_hits > 0, "the later rounds should have hit the prefix cache"
    for round_prompts, round_answers in zip(rounds, ours, strict=True):
        for prompt, answer in zip(round_prompts, round_answers, strict=True):
            expected = hf_greedy(hf, prompt, max_tokens)
            assert answer.tokens == expected.tokens, f"prompt of {len(prompt)} tokens"
            torch.testing.assert_close(
                torch.tensor(answer.logprobs), torch.tensor(expected.logprobs), atol=atol, rtol=0
            )
