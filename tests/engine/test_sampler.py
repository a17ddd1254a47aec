"""The sampler alone (server/sample/sampler.py), on hand-made logits: device placement on every path,
the order of the filters, allowed_token_ids, bad words, penalties, and a row that fails alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.request import Request
from pagedserve.server.sample import sampler
from pagedserve.server.sample.sampler import sample, sample_each, sample_on_device
from pagedserve.server.sampling_params import SamplingParams
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

VOCAB = 32
EOS = 2


def make_request(
    params: SamplingParams,
    output: list[int] | None = None,
    seed: int | None = None,
    bad_words: list[list[int]] | None = None,
    request_id: str = "r",
) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7, 5],
        params=params,
        max_tokens=64,
        eos_token_ids=frozenset({EOS}),
        metrics=RequestMetrics(arrival_time=0.0),
        output_token_ids=list(output or []),
        bad_words_token_ids=bad_words or [],
    )
    if seed is not None:
        request.generator = torch.Generator().manual_seed(seed)
    return request


class OnOneDevice(TorchDispatchMode):
    """Fails any op that touches a tensor off ``device`` (a CPU scalar aside, which CUDA allows too): the
    check a GPU makes, on a machine without one. A meta tensor cannot draw from a generator, so a
    seeded draw is made on the generator's own device (where the core creates it) and its meta result
    kept; the generator still advances, so a draw that skipped it would show."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops.append(str(func))
        generator = kwargs.get("generator")
        if generator is not None and args[0].device == self.device:
            func(torch.empty(args[0].shape, device=generator.device), *args[1:], **kwargs)
            return args[0]
        out = func(*args, **kwargs)
        for tensor in tree_flatten((args, kwargs, out))[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device != self.device:
                assert tensor.device.type == "cpu" and tensor.dim() == 0, (
                    f"{func} touches a {tensor.device} tensor of shape {tuple(tensor.shape)}"
                )
        return out


def every_path() -> list[Request]:
    """One batch that takes every branch of the sampler."""
    return [
        make_request(SamplingParams(temperature=0.0)),
        make_request(SamplingParams(temperature=0.0, logit_bias={3: 5.0, 4: -5.0}, logprobs=2)),
        make_request(SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[9]), output=[1]),
        make_request(
            SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5,
                           repetition_penalty=1.3, logprobs=0),
            output=[8, 8, 9],
        ),
        make_request(SamplingParams(temperature=0.0, allowed_token_ids=[10, 11])),
        make_request(SamplingParams(temperature=0.0), output=[12, 13], bad_words=[[13, 14], [15]]),
        make_request(SamplingParams(temperature=0.8, top_k=5, top_p=0.9)),
        make_request(SamplingParams(temperature=1.0, min_p=0.1, logprobs=3), seed=7),
        make_request(SamplingParams(temperature=1.0, top_p=0.5, min_p=0.05, repetition_penalty=1.1),
                     output=[3], seed=8),
        make_request(SamplingParams(temperature=1.2, allowed_token_ids=[1, 2, 3]), output=[13],
                     bad_words=[[13, 2]]),
    ]


def test_every_sampler_path_stays_on_the_logits_device() -> None:
    """Issue 14 item 1: a CPU index or value tensor beside CUDA logits raised and failed the batch."""
    requests = every_path()
    device = torch.device("meta")
    logits = torch.empty(len(requests), VOCAB, device=device)
    states = [r.generator.get_state() for r in requests if r.generator is not None]
    check = OnOneDevice(device)
    with check:
        out = sample_on_device(logits, requests)
    assert out.token_ids.device == device and out.token_ids.shape == (len(requests),)
    assert out.logprobs is not None and out.logprobs.chosen.device == device
    assert out.logprobs.top_ids is not None and out.logprobs.top_ids.shape == (len(requests), 3)
    seeded = [r.generator for r in requests if r.generator is not None]
    assert all(bool((g.get_state() != s).any()) for g, s in zip(seeded, states, strict=True))
    # Each path ran: an op only that path makes.
    for op in ("aten.index_put", "aten.index_copy", "aten.masked_fill", "aten.sort", "aten.topk",
               "aten.exponential_", "aten._log_softmax"):
        assert any(o.startswith(op) for o in check.ops), op


@pytest.mark.parametrize("device", [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ]),
])
def test_every_sampler_path_gives_tokens(device: str) -> None:
    requests = every_path()
    for request in requests:
        if request.generator is not None:  # the core makes them on its device
            request.generator = torch.Generator(device=device).manual_seed(request.generator.initial_seed())
    tokens = sample(torch.randn(len(requests), VOCAB, device=device), requests)
    assert [t.token_id for t in tokens][4] in (10, 11)
    assert tokens[9].token_id in (1, 3)  # 2 is banned after 13
    assert tokens[1].top_ids is not None and len(tokens[1].top_ids) == 2
    assert tokens[3].top_ids == [] and tokens[3].rank is not None
    assert tokens[0].logprob is None


def test_min_p_filters_before_top_p() -> None:
    """vLLM's order. Probabilities 0.4, 0.3, 0.2, 0.1 with min_p 0.6 keep 0.4 and 0.3 (4/7 and 3/7 once
    renormalised), and then top_p 0.5 keeps only the first. Top-p first would keep both, and min-p then
    too: token 1 would come up about 3 draws in 7."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    rows = 64
    logits = torch.log(probs).expand(rows, VOCAB).clone()
    requests = [make_request(SamplingParams(min_p=0.6, top_p=0.5), seed=row) for row in range(rows)]
    assert {t.token_id for t in sample(logits, requests)} == {0}


def test_allowed_token_ids_are_the_only_choices() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 50.0  # by far the likeliest, and not allowed
    requests = [
        make_request(SamplingParams(temperature=0.0, allowed_token_ids=[7, 9])),
        make_request(SamplingParams(temperature=1.0, allowed_token_ids=[7, 9]), seed=3),
    ]
    for _ in range(8):
        assert {t.token_id for t in sample(logits, requests)} <= {7, 9}


def test_a_huge_temperature_keeps_masked_tokens_out() -> None:
    """A temperature past float32's range (1e126 reached the server in a fuzz run) spreads the choice over
    the allowed tokens; it made every logit NaN once, and the sampler then picked a masked one."""
    logits = torch.randn(1, VOCAB)
    request = make_request(SamplingParams(temperature=1e126, allowed_token_ids=[7, 9]), seed=0)
    assert {sample(logits, [request])[0].token_id for _ in range(16)} == {7, 9}


def test_bad_word_last_token_is_banned_only_after_its_prefix() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 20] = 10.0
    logits[:, 21] = 5.0
    words = [[30, 31, 20], [21]]
    requests = [
        make_request(SamplingParams(temperature=0.0), output=[1, 30, 31], bad_words=words),  # prefix met
        make_request(SamplingParams(temperature=0.0), output=[30, 1, 31], bad_words=words),  # not met
        make_request(SamplingParams(temperature=0.0), output=[], bad_words=[[20]]),  # one token: always
    ]
    assert [t.token_id for t in sample(logits, requests)] == [0, 20, 21]


def test_penalties_as_defined() -> None:
    """Repetition divides positive (multiplies negative) logits of prompt and output tokens; frequency
    subtracts per occurrence in the output, presence once."""
    logits = torch.linspace(-3.0, 3.0, VOCAB).unsqueeze(0)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.25,
                            presence_penalty=0.5)
    request = make_request(params, output=[30, 30, 1])
    captured: list[torch.Tensor] = []
    original = sampler._choose

    def spy(penalised: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        captured.append(penalised)
        return original(penalised, requests)

    expected = logits[0].clone()
    for token in (5, 6, 7, 30, 1):  # prompt and output
        value = expected[token]
        expected[token] = value / 2.0 if value > 0 else value * 2.0
    expected[30] -= 0.25 * 2 + 0.5
    expected[1] -= 0.25 + 0.5
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "_choose", spy)
        sample(logits, [request])
    torch.testing.assert_close(captured[0][0], expected)


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    """The batch fails after the seeded draws; each row is then sampled alone, the doomed one's error
    is its own, and the seeded row, rewound, draws what it draws without the doomed row beside it."""
    logits = torch.randn(3, VOCAB)
    requests = [
        make_request(SamplingParams(temperature=1.0), seed=11, request_id="seeded"),
        make_request(SamplingParams(temperature=0.0, logprobs=1), request_id="doomed"),
        make_request(SamplingParams(temperature=0.0), request_id="greedy"),
    ]
    alone = sample(logits[:1], [make_request(SamplingParams(temperature=1.0), seed=11)])[0]
    original = sampler._logprob_tensors

    def broken(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[Request]) -> Any:
        if any(r.request_id == "doomed" for r in rows):
            raise RuntimeError("injected failure")
        return original(raw, token_ids, rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "_logprob_tensors", broken)
        seeded, doomed, greedy = sample_each(logits, requests)
    assert isinstance(doomed, RuntimeError)
    assert not isinstance(seeded, Exception) and seeded.token_id == alone.token_id
    assert not isinstance(greedy, Exception) and greedy.token_id == int(logits[2].argmax())


@pytest.mark.parametrize("field, value", [
    ("logprobs", 0), ("min_tokens", 3), ("logit_bias", {4: 50.0}), ("allowed_token_ids", [4, 9]),
    ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("repetition_penalty", 1.3),
    ("bad_words", ["x"]), ("temperature", 0.7),
])
def test_only_plain_greedy_rows_take_the_argmax_alone(field: str, value: Any) -> None:
    """A batch of plain greedy rows is one argmax; one field that changes the logits or asks for more
    sends the batch through every step, where that field acts."""
    assert SamplingParams(temperature=0.0).argmax_only
    params = SamplingParams(**{"temperature": 0.0, field: value})
    assert not params.argmax_only
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = [make_request(SamplingParams(temperature=0.0), output=[5, 6]) for _ in range(3)]
    assert sample(logits, plain) == [sampler.SampledToken(t) for t in logits.argmax(dim=-1).tolist()]
    if field == "logit_bias":  # the biased row takes the biased token; the plain rows keep theirs
        mixed = [*plain[:2], make_request(params, output=[5, 6])]
        tokens = [t.token_id for t in sample(logits, mixed)]
        assert tokens == [*logits.argmax(dim=-1).tolist()[:2], 4]


def test_a_bad_word_alone_keeps_the_batch_off_the_argmax_path() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 5.0
    request = make_request(SamplingParams(temperature=0.0), output=[], bad_words=[[9]])
    assert sample(logits, [request])[0].token_id != 9
