"""Prompt sets for the benchmarks: random text, shared-prefix groups, JSONL files, random token ids.

Stdlib only (a tokenizer is optional and imported lazily), so `pagedserve bench serve` runs with nothing
but httpx and tqdm installed.

Without a tokenizer, text prompts are built from a list of common English words, each of which is one
token (with its leading space) in the usual BPE vocabularies, so ``input_len`` words come out close to
``input_len`` tokens; the benchmark takes the exact counts from the server's ``usage`` anyway. With a
tokenizer the prompts are cut to exactly ``input_len`` tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Common English words: one token each (with a leading space) in GPT-2/Llama/SmolLM-style BPE vocabularies.
_WORDS_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but have an
    they you were her she there one all we their been has would when who will more if no out so said what
    up its about into than them can only other new some could time these two may then do first any my now
    such like our over man me even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state good very make world
    still own see men work long get here between both life being under never day same another know while
    last might us great old year off come since against go came right used take three states himself few
    house use during without again place around however home small found thought went say part once general
    high upon school every does got united left number course war until always away something fact though
    water less public put think almost hand enough far took head yet government system better set told
    nothing night end why called didn find look going asked later knew point next program city business give
    group toward young days let room president side social given present several order national possible
    rather second face per among form important often things looked early white case john become large big
    need four within felt along children saw best church ever least power development light thing seemed
    family interest want members mind country area others done turned although open god service problem
    certain kind different thus began door help sense whole matter perhaps itself yes times law human line
    above name example action company hands local show whether five history gave today either act feet across
    taken past quite anything seen having death week experience body word half really field car words already
    themselves information tell together college shall money period held keep sure free real probably seems
    behind cannot political air question making office brought whose special heard major problems ago became
    federal moment study available known result street economic boy position reason change south board
    individual job society areas west close turn love community true court force full seem am wife future age
    wanted department voice center woman control common necessary policy front six girl clear further land
    """
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())


@dataclass
class SampleRequest:
    """One benchmark request: a prompt (or chat messages) and the number of tokens to generate."""

    prompt: str
    output_len: int
    system: str | None = None  # shared prefix: the system message (chat) or the head of the prompt
    messages: list[dict[str, Any]] | None = None  # given verbatim by a JSONL file (chat endpoint)
    expected_input_len: int | None = None  # what the generator aimed for (the server's usage is the truth)
    group: int | None = None  # shared-prefix group
    extra: dict[str, Any] = field(default_factory=dict)

    def completion_prompt(self) -> str:
        if self.messages is not None:
            return "\n\n".join(str(m.get("content", "")) for m in self.messages)
        if self.system:
            return f"{self.system}\n\n{self.prompt}"
        return self.prompt

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return self.messages
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": self.prompt})
        return messages


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 0)))


class _Cutter:
    """Cuts word text to an exact token count: decode a prefix of its ids, check by re-encoding."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def text_of_len(self, rng: random.Random, n: int) -> str:
        if n <= 0:
            return ""
        text = random_words(rng, n + 8)
        ids = self.encode(text)
        while len(ids) < n:  # words that split into several tokens only make this rarer
            text += " " + random_words(rng, n - len(ids) + 8)
            ids = self.encode(text)
        want = n
        for _ in range(8):  # re-encoding a decoded prefix may merge or split at the cut; adjust
            cut = self.tok.decode(ids[:want])
            got = len(self.encode(cut))
            if got == n:
                return cut
            want += n - got
            want = max(1, min(want, len(ids)))
        return cut


def _lengths(rng: random.Random, mean: int, range_ratio: float, count: int) -> list[int]:
    if range_ratio <= 0:
        return [mean] * count
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(count)]


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    range_ratio: float = 0.0,
    tokenizer: Any = None,
) -> list[SampleRequest]:
    """Independent random prompts (no two share a prefix), about ``input_len`` tokens each."""
    rng = random.Random(seed)
    cutter = _Cutter(tokenizer) if tokenizer is not None else None
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    out = []
    for i in range(num_prompts):
        text = cutter.text_of_len(rng, in_lens[i]) if cutter else random_words(rng, in_lens[i])
        out.append(SampleRequest(prompt=text, output_len=out_lens[i], expected_input_len=in_lens[i]))
    return out


def shared_prefix_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    num_groups: int = 8,
    prefix_len: int = 512,
    seed: int = 0,
    tokenizer: Any = None,
) -> list[SampleRequest]:
    """``num_groups`` long system prompts of ``prefix_len`` tokens, each shared by a group of requests whose
    own question is ``input_len`` tokens. Requests of all groups arrive interleaved (seeded shuffle): this
    is the workload where routing by prefix pays off, since each replica only needs some of the groups'
    prefixes in its KV cache.
    """
    if num_groups < 1:
        raise ValueError("shared-prefix needs at least one group")
    rng = random.Random(seed)
    cutter = _Cutter(tokenizer) if tokenizer is not None else None

    def text(n: int) -> str:
        return cutter.text_of_len(rng, n) if cutter else random_words(rng, n)

    prefixes = [text(prefix_len) for _ in range(num_groups)]
    out = []
    for i in range(num_prompts):
        g = i % num_groups
        out.append(
            SampleRequest(
                prompt=text(input_len),
                output_len=output_len,
                system=prefixes[g],
                group=g,
                expected_input_len=prefix_len + input_len,
            )
        )
    rng.shuffle(out)
    return out


def jsonl_dataset(path: str | Path, num_prompts: int | None, output_len: int) -> list[SampleRequest]:
    """One JSON object a line: ``prompt`` (text) or ``messages`` (chat), optional ``system`` and
    ``output_len`` / ``max_tokens`` (default: ``output_len``). The first ``num_prompts`` lines are used."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
                raise ValueError(f"{path}:{lineno}: expected an object with 'prompt' or 'messages'")
            n = obj.get("output_len", obj.get("max_tokens", output_len))
            out.append(
                SampleRequest(
                    prompt=str(obj.get("prompt", "")),
                    output_len=int(n),
                    system=obj.get("system"),
                    messages=obj.get("messages"),
                )
            )
            if num_prompts is not None and len(out) >= num_prompts:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def parse_range(text: str) -> tuple[int, int]:
    """``"20:400"`` -> (20, 400); ``"128"`` -> (128, 128)."""
    parts = str(text).split(":")
    if len(parts) == 1:
        lo = hi = int(parts[0])
    elif len(parts) == 2:
        lo, hi = int(parts[0]), int(parts[1])
    else:
        raise ValueError(f"bad range {text!r}: expected LO:HI")
    if lo < 1 or hi < lo:
        raise ValueError(f"bad range {text!r}: need 1 <= LO <= HI")
    return lo, hi


def random_token_prompts(
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    special_ids: Sequence[int] = (),
    seed: int = 0,
) -> list[tuple[list[int], int]]:
    """Random token-id prompts and output lengths, uniform in the ranges (the offline throughput workload)."""
    rng = random.Random(seed)
    special = set(special_ids)
    out = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_range)
        n_out = rng.randint(*output_range)
        ids = []
        while len(ids) < n_in:
            t = rng.randrange(vocab_size)
            if t not in special:
                ids.append(t)
        out.append((ids, n_out))
    return out
