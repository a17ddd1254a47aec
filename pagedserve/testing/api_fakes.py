"""The real AsyncEngine over a scripted core (no model), so the HTTP layer is tested in-process, fast.

The tokenizer is byte-level: token id = byte + 3, ids 0..2 are <pad>, <s>, </s>. The core "generates" a
fixed script, one token per sample per step: sample i of a request emits SCRIPT rotated by i, so n > 1
gives distinct choices. Everything else (request checks, detokenization, stop strings, logprob strings,
output kinds, aborts) is the engine's own front end (server/engine/).
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any

import httpx

from pagedserve.server.api.app import ServerSettings, build_app
from pagedserve.server.engine.async_engine import AsyncEngine
from pagedserve.server.engine.core_output import EngineCoreOutput, EngineStats
from pagedserve.server.engine.processor import Processor
from pagedserve.server.lora_request import LoRALoadError
from pagedserve.server.outputs import SampledToken
from pagedserve.server.request import Request

SCRIPT = "Paris is the capital of France. "
OFFSET = 3
EOS_MARK = "\x04"  # in SCRIPT: the fake model samples its EOS token there (scripted(..., eos=True))


class FakeTokenizer:
    eos_token_id = 2
    # Renders as apply_chat_template below does (the server renders templates itself: chat_template.py).
    chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )

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


class ScriptedCore:
    """Stands in for server/engine/core.py's EngineCore: the same methods, a script instead of a model.

    Each step emits the next script character of every running sample (sample i starts i characters
    in); max_tokens and max_model_len finish a sample, EOS never comes.
    """

    def __init__(self, max_model_len: int, step_delay: float, num_blocks: int) -> None:
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
            attention_backend="scripted",  # what /version reports: no kernels run here
            quantization=None,
            kv_cache_dtype="auto",
            speculative_config=None,
        )
        self.model_path = ""
        self.vocab_size = len(FakeTokenizer())
        self.step_delay = step_delay
        self.num_blocks = num_blocks
        self.requests: dict[str, Request] = {}
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.prompt_tokens = self.generation_tokens = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.prompt_tokens += request.num_prompt_tokens

    # What the real core does for tensor parallelism, LoRA and KV events: none of them here.
    def check_alive(self) -> None:
        pass

    def on_death(self, callback: object) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def take_kv_events(self) -> list[object]:
        return []

    def load_lora(self, lora: object) -> None:
        raise LoRALoadError("LoRA is not enabled: start the engine with --enable-lora.")

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(self.step_delay)
        outputs = [self._advance(r, time.time()) for r in list(self.requests.values())]
        for output in outputs:
            if output.finish_reason is not None:
                del self.requests[output.request_id]
                self.finished.append(output.request_id)
        return outputs

    def _advance(self, request: Request, now: float) -> EngineCoreOutput:
        index = int(request.request_id.rsplit("#", 1)[1]) if "#" in request.request_id else 0
        script = SCRIPT[index % len(SCRIPT) :] + SCRIPT[: index % len(SCRIPT)]
        char = script[request.num_output_tokens % len(script)]
        token = FakeTokenizer.eos_token_id if char == EOS_MARK else ord(char) + OFFSET
        request.output_token_ids.append(token)
        self.generation_tokens += 1
        metrics = request.metrics
        metrics.first_scheduled_time = metrics.first_scheduled_time or now
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        finish = "stop" if token == FakeTokenizer.eos_token_id else None
        if finish:
            metrics.finished_time = now
        elif (request.num_output_tokens >= request.max_tokens
              or request.num_tokens >= self.config.max_model_len):
            finish, metrics.finished_time = "length", now
        k = request.params.logprobs
        logprobs = [self._scripted_logprob(token, k)] if k is not None else None
        prompt_logprobs = None
        if request.prompt_logprobs is not None and request.num_output_tokens == 1:
            prompt_logprobs = [self._scripted_logprob(t, request.params.prompt_logprobs or 0)
                               for t in request.prompt_token_ids[1:]]
        return EngineCoreOutput(
            request.request_id, [token], logprobs, finish, None, 0, metrics, prompt_logprobs, token_time=now
        )

    @staticmethod
    def _scripted_logprob(token: int, k: int) -> SampledToken:
        """The scripted logprobs of one position: ``token`` at -0.25 (rank 1), then "c", "d", ... ."""
        alternatives = [ord("a") + rank + OFFSET for rank in range(2, k + 1)]
        top_logprobs = [-0.25, *(-1.0 * rank for rank in range(2, k + 1))]
        return SampledToken(token, -0.25, 1, [token, *alternatives][:k], top_logprobs[:k])

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.requests),
            num_waiting=0,
            kv_cache_usage=len(self.requests) / self.num_blocks,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_preemptions=0,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_gpu_blocks=self.num_blocks,
            block_size=16,
        )


class FakeEngine(AsyncEngine):
    """The real AsyncEngine (an EngineClient) over a ScriptedCore: only the model is fake."""

    def __init__(self, max_model_len: int = 128, step_delay: float = 0.0, num_blocks: int = 64) -> None:
        core = ScriptedCore(max_model_len, step_delay, num_blocks)
        tokenizer = FakeTokenizer()
        processor = Processor(
            tokenizer,
            core.vocab_size,
            max_model_len,
            core.config.max_num_seqs,
            frozenset({tokenizer.eos_token_id}),
        )
        super().__init__(core, tokenizer, processor)  # type: ignore[arg-type]
        self.scripted = core

    @property
    def step_delay(self) -> float:
        return self.scripted.step_delay

    @step_delay.setter
    def step_delay(self, seconds: float) -> None:
        self.scripted.step_delay = seconds

    @property
    def running(self) -> set[str]:
        return set(self.scripted.requests)

    @property
    def aborted(self) -> list[str]:
        return self.scripted.aborted

    @property
    def finished(self) -> list[str]:
        return self.scripted.finished


def scripted(monkeypatch: Any, reply: str, eos: bool = False) -> dict[str, Any]:
    """The fake model replies ``reply`` (ASCII), one character a step, then stops: the request fields
    that make it stop there (a stop string; with ``eos``, its EOS token: for APIs without stop strings).
    ``monkeypatch``: pytest's, which restores the script after the test."""
    monkeypatch.setattr(sys.modules[__name__], "SCRIPT", reply + (EOS_MARK if eos else "\x00"))
    return {"max_tokens": len(reply) + 5, **({} if eos else {"stop": ["\x00"]})}


async def app_client(engine: FakeEngine, **settings: Any) -> httpx.AsyncClient:
    """An HTTP client of ``build_app(engine, ServerSettings(**settings))``, in-process; starts the engine."""
    app = build_app(engine, ServerSettings(**settings))  # type: ignore[arg-type]
    await engine.start()  # httpx's ASGI transport does not run the lifespan
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def assert_400(response: httpx.Response, param: str) -> str:
    """A 400 in OpenAI's error shape naming ``param``; its message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    return error["message"]
