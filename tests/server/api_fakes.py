"""A stand-in for AsyncEngine (the engine contract, no model) so the HTTP layer is tested in-process, fast.

The tokenizer is byte-level: token id = byte + 3, ids 0..2 are <pad>, <s>, </s>. The engine "generates" a
fixed script, one token per sequence per step: sequence i of a request emits SCRIPT rotated by i, so n > 1
gives distinct choices, and stop strings, max_tokens, logprobs and abort behave as the contract says.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pagedserve.server.engine.output import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.server.sampling_params import SamplingParams

SCRIPT = "Paris is the capital of France. "
OFFSET = 3


class FakeTokenizer:
    eos_token_id = 2
    chat_template = "fake"

    def __len__(self) -> int:
        return 256 + OFFSET

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + OFFSET for b in text.encode("utf-8")]
        return [1, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - OFFSET for i in ids if i >= OFFSET)
        return data.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [["<pad>", "<s>", "</s>"][i] if i < OFFSET else chr(i - OFFSET) for i in ids]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: Any = None,
        chat_template: str | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        if chat_template == "broken":
            raise ValueError("template exploded")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in conversation)
        if continue_final_message:
            text = text[:-1]
        if add_generation_prompt:
            text += "<assistant>"
        return text


@dataclass
class _Seq:
    index: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class FakeEngine:
    def __init__(self, max_model_len: int = 128, step_delay: float = 0.0, num_blocks: int = 64) -> None:
        self.config = SimpleNamespace(
            max_model_len=max_model_len,
            max_num_seqs=16,
            served_model_name="fake-model",
            model=None,
            enable_prefix_caching=True,
            gpu_memory_utilization=0.9,
            kv_cache_memory_bytes=None,
            num_gpu_blocks_override=None,
            block_size=16,
        )
        self.tokenizer = FakeTokenizer()
        self.step_delay = step_delay
        self.num_blocks = num_blocks
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.started = False
        self.shutdown_called = False
        self.prompt_tokens = self.generation_tokens = 0

    async def start(self) -> None:
        self.started = True

    async def shutdown(self, grace_seconds: float = 30.0) -> None:
        self.shutdown_called = True

    def is_healthy(self) -> bool:
        return self.started and not self.shutdown_called

    def stats(self) -> Any:
        return SimpleNamespace(
            num_running=len(self.running),
            num_waiting=0,
            kv_cache_usage=len(self.running) / self.num_blocks,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_preemptions=0,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_gpu_blocks=self.num_blocks,
            block_size=16,
        )

    async def abort(self, request_id: str) -> None:
        self.running.discard(request_id)

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str):
        ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if any(t < 0 or t >= len(self.tokenizer) for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {len(self.tokenizer)})")
        max_tokens = params.max_tokens or self.config.max_model_len - len(ids)
        if len(ids) + max_tokens > self.config.max_model_len:
            raise ValueError(f"max_model_len is {self.config.max_model_len}")
        metrics = RequestMetrics(arrival_time=time.time())
        seqs = [_Seq(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self.running.add(request_id)
        self.prompt_tokens += len(ids)
        finished = False
        try:
            while True:
                await asyncio.sleep(self.step_delay)
                now = time.time()
                metrics.first_scheduled_time = metrics.first_scheduled_time or now
                for seq in seqs:
                    if seq.finish_reason is None:
                        self._step(seq, params, max_tokens)
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                finished = all(s.finish_reason is not None for s in seqs)
                if finished:
                    metrics.finished_time = now
                    self.running.discard(request_id)
                    self.finished.append(request_id)
                text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
                yield RequestOutput(
                    request_id=request_id,
                    prompt=text,
                    prompt_token_ids=ids,
                    num_cached_tokens=0,
                    finished=finished,
                    metrics=metrics,
                    outputs=[
                        CompletionOutput(
                            s.index,
                            s.text,
                            list(s.tokens),
                            None,
                            list(s.logprobs) if s.logprobs is not None else None,
                            s.finish_reason,
                            s.stop_reason,
                        )
                        for s in seqs
                    ],
                )
                if finished:
                    return
        finally:
            if not finished:
                self.running.discard(request_id)
                self.aborted.append(request_id)

    def _step(self, seq: _Seq, params: SamplingParams, max_tokens: int) -> None:
        script = SCRIPT[seq.index % len(SCRIPT) :] + SCRIPT[: seq.index % len(SCRIPT)]
        char = script[len(seq.tokens) % len(script)]
        token = ord(char) + OFFSET
        seq.tokens.append(token)
        self.generation_tokens += 1
        if seq.logprobs is not None:
            step = {token: Logprob(-0.25, 1, char)}
            for rank in range(2, (params.logprobs or 0) + 1):
                step.setdefault(ord("a") + rank + OFFSET, Logprob(-1.0 * rank, rank, chr(ord("a") + rank)))
            seq.logprobs.append(step)
        seq.text += char
        for stop in params.stop_strings:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[: at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if len(seq.tokens) >= max_tokens:
            seq.finish_reason = "length"
