"""Every check a request passes before it runs, in one place (vLLM's Processor).

``Processor.process`` tokenizes the prompt input, checks it against the model (empty prompt, token ids
in the vocabulary, length vs max_model_len, n vs max_num_seqs), resolves max_tokens by vLLM's rule,
compiles ``structured_outputs`` (server/structured_output/compiler.py: cached, bounded in time), checks
that a request's LoRA adapter is loaded (the adapters' registry of the front end lives here) and
makes one core Request per sample, each with its own grammar matcher. A pooling request (``PoolingParams``)
becomes one core Request whose params are the model's pooler (server/loader/pooler_config.py) with the
request's choices over it; each runner takes only its own kind of request. A refusal is an
``InvalidRequestError`` naming the field: the offline LLM lets it raise, the server turns it into an
OpenAI 400 (server/api/serving_base.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.kv_transfer_config import KVTransferConfig
from pagedserve.server.kv_transfer_params import (
    KVTransfer,
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
)
from pagedserve.server.loader.generation_config import sampling_defaults
from pagedserve.server.lora_request import LoRALoadError, LoRARequest
from pagedserve.server.multimodal import (
    MODALITIES,
    GridImageProcessor,
    ImageInput,
    as_images,
    mrope_positions,
    process_images,
)
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.request import Request
from pagedserve.server.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedserve.server.config import EngineConfig
    from pagedserve.server.engine.core import EngineCore
    from pagedserve.server.loader.pooler_config import PoolerConfig
    from pagedserve.server.structured_output.compiler import CompiledGrammar, GrammarCompiler

PromptInput = str | list[int] | dict[str, Any]
# SamplingParams fields whose None means "unset" (they have no None of their own): the model's default, if
# any, else SamplingParams'
UNSET_IS_DEFAULT = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
)
# A pooling request's core params: it samples nothing, and its one output comes when it has finished.
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass(frozen=True)
class ImageProcessing:
    """A vision-language model's front-end half: its Transformers processor and image token."""

    processor: Any  # the checkpoint's AutoProcessor: image processor and tokenizer
    image_token_id: int
    limit: int | None  # images per prompt at most (--limit-mm-per-prompt); None: as many as fit
    spatial_merge_size: int | None = None  # multimodal RoPE's (Qwen2-VL): patches merged per side


@dataclass
class ProcessedRequest:
    """One caller's request, checked: its prompt, and one core Request per sample (n of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # a pooling request's: POOLING_SAMPLING
    max_tokens: int
    children: list[Request]


class Processor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        eos_token_ids: frozenset[int],
        generation_defaults: dict[str, Any] | None = None,
        enable_lora: bool = False,
        lora_requests: list[LoRARequest] | None = None,
        pooler: PoolerConfig | None = None,
        images: ImageProcessing | None = None,
        kv_transfer: KVTransferConfig | None = None,
    ) -> None:
        """``pooler``: the model's, under the pooling runner (which takes only pooling requests); None under
        the generate runner. ``images``: a vision-language model's processor (None: text only)."""
        self.tokenizer = tokenizer
        self.kv_transfer = kv_transfer  # prefill/decode disaggregation's connector (None: off)
        self.pooler = pooler
        self.images = images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = eos_token_ids
        # The model's sampling defaults (server/loader/generation_config.py), for fields a request leaves
        # unset: applied by sampling_params, and by _max_tokens to max_tokens.
        self.generation_defaults = dict(generation_defaults or {})
        self._grammar_compiler: GrammarCompiler | None = None
        # The adapters requests may name (server/lora/): the front end's copy of the core's registry,
        # changed only by register_lora / unregister_lora, which the engines call before telling the core.
        self.enable_lora = enable_lora
        self.lora_requests: dict[str, LoRARequest] = {lora.lora_name: lora for lora in lora_requests or []}

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Made on the first structured request: an engine that never sees one never loads llguidance."""
        if self._grammar_compiler is None:
            from pagedserve.server.structured_output.compiler import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """A request's parameters: the fields it sets over the model's sampling defaults (vLLM's
        ``get_diff_sampling_param``), checked by SamplingParams (InvalidRequestError naming the field). A
        field of ``UNSET_IS_DEFAULT`` given as None is unset. The one place the defaults apply: the server
        maps each OpenAI request here, the offline LLM calls it with no fields."""
        for name, value in self.generation_defaults.items():
            if fields.get(name) is None:
                # max_tokens stays None: _max_tokens applies the model's default within the context left
                fields[name] = None if name == "max_tokens" else value
        return SamplingParams(**{
            name: value for name, value in fields.items() if value is not None or name not in UNSET_IS_DEFAULT
        })

    def default_sampling_params(self) -> SamplingParams:
        """What a caller that gives no SamplingParams gets (vLLM's ``LLM.get_default_sampling_params``)."""
        return self.sampling_params()

    def register_lora(self, lora: LoRARequest) -> None:
        """Refuse an adapter whose name or id is taken (vLLM's messages); else requests may name it."""
        if not self.enable_lora:
            raise LoRALoadError("LoRA is not enabled: start the engine with --enable-lora.")
        if lora.lora_name in self.lora_requests:
            raise LoRALoadError(f"The lora adapter '{lora.lora_name}' has already been loaded.")
        if any(known.lora_int_id == lora.lora_int_id for known in self.lora_requests.values()):
            raise LoRALoadError(f"lora_int_id {lora.lora_int_id} is already used by another adapter.")
        self.lora_requests[lora.lora_name] = lora

    @contextmanager
    def registering_lora(self, lora: LoRARequest) -> Iterator[None]:
        """``register_lora``, taken back if the body raises (the adapter's files or the core refused it):
        the one way both engines add an adapter."""
        self.register_lora(lora)
        try:
            yield
        except BaseException:
            self.unregister_lora(lora.lora_name)
            raise

    def unregister_lora(self, lora_name: str) -> LoRARequest:
        """The adapter no new request may name; KeyError when none has that name."""
        return self.lora_requests.pop(lora_name)

    def lora_named(self, name: str) -> LoRARequest:
        """The loaded adapter a request names (its ``model``); InvalidRequestError (model_not_found, the
        API's 404) when there is none: the one place a name is decided to be an adapter or nothing."""
        known = self.lora_requests.get(name)
        if known is None:
            raise InvalidRequestError(f"The model `{name}` does not exist.", param="model",
                                      code="model_not_found")
        return known

    def _check_lora(self, lora: LoRARequest | None) -> None:
        if lora is None:
            return
        if not self.enable_lora:
            raise InvalidRequestError("LoRA is not enabled: start the engine with --enable-lora.",
                                      param="model")
        known = self.lora_named(lora.lora_name)
        if known != lora:
            raise InvalidRequestError(
                f"LoRA adapter `{lora.lora_name}` is loaded as {known}, not as {lora}.", param="model"
            )

    def process(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        self._check_runner(params)
        self._check_lora(lora_request)
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            prompt = self.process_images(prompt)  # the async engine did it already, off its event loop
        mm_inputs: list[ImageInput] = prompt.get("mm_inputs", []) if isinstance(prompt, dict) else []
        mrope = prompt.get("mrope", (None, 0)) if isinstance(prompt, dict) else (None, 0)
        text, token_ids = self._tokenize(prompt)
        cache_salt = self._cache_salt(prompt)
        arrival = arrival_time if arrival_time is not None else time.time()
        if isinstance(params, PoolingParams):
            self._check_prompt(token_ids, room=0)
            request = Request(request_id, token_ids, POOLING_SAMPLING, 1, frozenset(),
                              RequestMetrics(arrival), cache_salt=cache_salt, lora_request=lora_request,
                              pooling=self._pooling(params), mm_inputs=mm_inputs, mrope_positions=mrope[0],
                              mrope_delta=mrope[1])
            return ProcessedRequest(request_id, text, token_ids, POOLING_SAMPLING, 1, [request])
        self._check_prompt(token_ids)
        max_tokens = self._max_tokens(params.max_tokens, len(token_ids))
        self._check_token_ids("logit_bias", params.logit_bias or {})
        self._check_token_ids("stop_token_ids", params.stop_token_ids or [])
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or [])
        bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(
                f"n must be at most max_num_seqs ({self.max_num_seqs}), got {params.n}.", param="n"
            )
        grammar = self._compile_grammar(params)
        kv_transfer = self._kv_transfer(params)
        gate = params.structured_outputs.think_gate if params.structured_outputs is not None else None
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        children = [
            Request(
                request_id=child_id(request_id, index, params.n),
                prompt_token_ids=token_ids,
                params=params,
                max_tokens=max_tokens,
                eos_token_ids=eos,
                metrics=RequestMetrics(arrival_time=arrival),
                seed=params.seed + index if params.seed is not None else None,
                bad_words_token_ids=bad_words_token_ids,
                cache_salt=cache_salt,
                lora_request=lora_request,
                # The request's prompt logprobs are computed once, by its first sample.
                prompt_logprobs=[] if params.prompt_logprobs is not None and index == 0 else None,
                grammar=grammar.new_state(gate) if grammar is not None else None,
                mm_inputs=mm_inputs,
                mrope_positions=mrope[0],
                mrope_delta=mrope[1],
                kv_transfer=kv_transfer,
            )
            for index in range(params.n)
        ]
        return ProcessedRequest(request_id, text, token_ids, params, max_tokens, children)

    def process_images(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """A prompt dict with vLLM's ``multi_modal_data`` -> the same with its token ids (each image's
        placeholder expanded) and ``mm_inputs``: the checkpoint's own processor over text and images (CPU
        work the async engine runs off its loop). ``add_special_tokens`` (default true, as for a text
        prompt): false for a rendered chat template, which holds them already. Refusals name the prompt."""
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - set(MODALITIES):
            raise InvalidRequestError(f"multi_modal_data takes {', '.join(MODALITIES)}", param="prompt")
        images = as_images(data.get("image", []))
        if not images:
            return {key: value for key, value in prompt.items() if key != "multi_modal_data"}
        if self.images is None:
            raise InvalidRequestError("This model takes text only: it is not a vision-language model.",
                                      param="prompt")
        limit = self.images.limit
        if limit is not None and len(images) > limit:
            raise InvalidRequestError(f"At most {limit} images may be sent per prompt "
                                      f"(--limit-mm-per-prompt); this one has {len(images)}.", param="prompt")
        if not isinstance(prompt.get("prompt"), str):
            raise InvalidRequestError("a prompt with images needs its text as 'prompt', with a placeholder "
                                      "per image", param="prompt")
        images_of = self.images
        token_ids, mm_inputs = process_images(images_of.processor, images_of.image_token_id, prompt["prompt"],
                                              images, prompt.get("add_special_tokens", True))
        done = ("multi_modal_data", "prompt", "add_special_tokens")
        rest = {key: value for key, value in prompt.items() if key not in done}
        processed = {**rest, "prompt": prompt["prompt"], "prompt_token_ids": token_ids,
                     "mm_inputs": mm_inputs}
        if images_of.spatial_merge_size is not None:
            processed["mrope"] = mrope_positions(len(token_ids), mm_inputs, images_of.spatial_merge_size)
        return processed

    def _check_runner(self, params: SamplingParams | PoolingParams) -> None:
        if isinstance(params, PoolingParams) and self.pooler is None:
            raise InvalidRequestError("This model runs the generate runner: it does not pool (embeddings, "
                                      "scores); start it with --runner pooling for that.", param="model")
        if isinstance(params, SamplingParams) and self.pooler is not None:
            raise InvalidRequestError("This model runs the pooling runner: it serves embeddings, pooling, "
                                      "scores and reranking, not generation.", param="model")

    def _pooling(self, params: PoolingParams) -> PoolingParams:
        """The request's choices over the model's pooler; ``dimensions`` only where the model was trained
        for it (Matryoshka), as vLLM checks."""
        pooler = self.pooler
        assert pooler is not None
        dimensions = params.dimensions
        if dimensions is not None:
            allowed = pooler.matryoshka_dimensions
            if allowed is None:
                raise InvalidRequestError(
                    "This model does not support matryoshka representation: changing its output dimensions "
                    "would give poor results.", param="dimensions",
                )
            if (allowed and dimensions not in allowed) or dimensions > pooler.hidden_size:
                choices = ", ".join(map(str, allowed)) if allowed else f"1 to {pooler.hidden_size}"
                raise InvalidRequestError(f"dimensions must be one of {choices}, got {dimensions}.",
                                          param="dimensions")
        return replace(
            params,
            pooling_type=params.pooling_type or pooler.pooling_type,
            normalize=pooler.normalize if params.normalize is None else params.normalize,
        )

    def _compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's grammar, compiled once for all its samples; refusals name the field."""
        if params.structured_outputs is None:
            return None
        return self.grammar_compiler.compile(params.structured_outputs)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._tokenize(str(prompt["prompt"]))
            raise InvalidRequestError("prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        return None, [int(t) for t in prompt]

    def _kv_transfer(self, params: SamplingParams) -> KVTransfer | None:
        """The request's role in a P/D pair (server/kv_transfer_params.py). An engine without a connector
        runs it as an ordinary request, as vLLM's does: a prefill answers no kv_transfer_params (the router
        then decodes it colocated), a decode computes its prompt."""
        transfer = parse_kv_transfer_params(params.kv_transfer_params)
        if transfer is None or self.kv_transfer is None:
            return None
        if params.n != 1:
            raise InvalidRequestError("kv_transfer_params needs n = 1.", param="n")
        role = self.kv_transfer.kv_role
        if isinstance(transfer, RemoteDecode) and not self.kv_transfer.produces:
            raise InvalidRequestError(f"kv_transfer_params: do_remote_decode needs a prefill engine; this "
                                      f"one's kv_role is {role}.", param="kv_transfer_params")
        if isinstance(transfer, RemotePrefill) and not self.kv_transfer.consumes:
            raise InvalidRequestError(f"kv_transfer_params: do_remote_prefill needs a decode engine; this "
                                      f"one's kv_role is {role}.", param="kv_transfer_params")
        return transfer

    @staticmethod
    def _cache_salt(prompt: PromptInput) -> str | None:
        """vLLM's ``cache_salt`` of a prompt dict: a non-empty string, or absent."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError("cache_salt must be a non-empty string.", param="cache_salt")
        return salt

    def _check_prompt(self, token_ids: list[int], room: int = 1) -> None:
        """``room``: tokens the request needs after its prompt (a pooling request none)."""
        limit = self.max_model_len
        if not token_ids:
            raise InvalidRequestError("The prompt must not be empty.", param="prompt")
        if any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size}).", param="prompt")
        if not room and len(token_ids) > limit:
            raise InvalidRequestError(
                f"This model's maximum context length (max_model_len) is {limit} tokens. However, your "
                f"request has {len(token_ids)} input tokens. Please reduce the length of the input.",
                param="prompt", code="context_length_exceeded",
            )
        if room and len(token_ids) >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length (max_model_len) is {limit} tokens. However, your "
                f"request has {len(token_ids)} input tokens, which leaves no room for a completion. Please "
                "reduce the length of the input.",
                param="prompt",
                code="context_length_exceeded",
            )

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """vLLM's rule: no max_tokens means the model's default (generation_config.json's max_new_tokens)
        within max_model_len, else up to max_model_len; asking over the limit is an error naming it."""
        limit = self.max_model_len
        if requested is None:
            return min(limit - prompt_len, self.generation_defaults.get("max_tokens", limit))
        if prompt_len + requested > limit:
            raise InvalidRequestError(
                f"This model's maximum context length (max_model_len) is {limit} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in "
                "max_tokens). Please reduce the length of the input or of max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def _check_token_ids(self, param: str, ids: Any) -> None:
        if any(int(t) < 0 or int(t) >= self.vocab_size for t in ids):
            raise InvalidRequestError(f"{param} must be token ids in [0, {self.vocab_size}).", param=param)

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token sequences, as vLLM's ``SamplingParams.update_from_tokenizer`` makes them:
        the word as written (it may start the text) and, when that is a different word token of the same
        length, after a space (the word inside the text)."""
        sequences: list[list[int]] = []
        for word in bad_words:
            alone = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            sequences.extend([alone] if alone else [])
            if alone and len(spaced) == len(alone) and spaced[0] != alone[0]:
                sequences.append(spaced)
        self._check_token_ids("bad_words", [t for sequence in sequences for t in sequence])
        return sequences


def child_id(request_id: str, index: int, n: int) -> str:
    """The core request id of sample ``index``: the caller's id itself when there is one sample."""
    return f"{request_id}#{index}" if n > 1 else request_id


def eos_token_ids(model_path: Path, tokenizer: Any) -> frozenset[int]:
    """The tokenizer's EOS and generation_config.json's eos_token_id(s): any of them ends a sequence."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = model_path / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


def load_tokenizer(config: EngineConfig, core: EngineCore) -> Any:
    """The tokenizer the front end uses: ``config.tokenizer`` or the model's own."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(config.tokenizer or core.model_path))


def make_processor(core: EngineCore, tokenizer: Any) -> Processor:
    """The request checks for this core's model and its resolved limits."""
    config = core.config
    assert config.max_model_len is not None  # resolved by the core
    return Processor(
        tokenizer,
        core.vocab_size,
        config.max_model_len,
        config.max_num_seqs,
        eos_token_ids(core.model_path, tokenizer),
        sampling_defaults(core.model_path, config.generation_config),
        enable_lora=config.enable_lora,
        lora_requests=core.list_loras(),
        pooler=load_pooler(config, core.model_path),
        images=load_image_processing(config, core.model_path),
        kv_transfer=config.kv_transfer_config,
    )


def load_image_processing(config: EngineConfig, model_path: Path) -> ImageProcessing | None:
    """The checkpoint's processor when it is a vision-language model, else None."""
    from pagedserve.server.loader import load_config
    from pagedserve.server.multimodal import is_mrope, takes_images

    hf_config = load_config(model_path)
    if not takes_images(hf_config):
        return None

    image_token_id = getattr(hf_config, "image_token_index", None)  # LLaVA's name; Qwen2-VL's is _id
    if image_token_id is None:
        image_token_id = hf_config.image_token_id
    limit = (config.limit_mm_per_prompt or {}).get("image")
    merge = hf_config.vision_config.spatial_merge_size if is_mrope(hf_config) else None
    return ImageProcessing(_hf_processor(model_path, int(image_token_id), merge), int(image_token_id), limit,
                           merge)


def _hf_processor(model_path: Path, image_token_id: int, merge_size: int | None) -> Any:
    """The checkpoint's AutoProcessor; for a grid model (Qwen2-VL) whose processor cannot be built without
    torchvision, its image processor and tokenizer in server/multimodal.py's ``GridImageProcessor``."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(str(model_path))
    except (AttributeError, ImportError, TypeError) as exc:
        if merge_size is None:
            raise
        logging.getLogger("pagedserve.engine").warning(
            "Transformers' processor of %s cannot be built (%s: torchvision is missing?); images are "
            "processed by its image processor and tokenizer", model_path, exc)
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        return GridImageProcessor(AutoImageProcessor.from_pretrained(str(model_path)), tokenizer, image_token,
                                  merge_size)


def load_pooler(config: EngineConfig, model_path: Path) -> PoolerConfig | None:
    """The model's pooler under the pooling runner (``config.runner`` as the core resolved it), else None."""
    if config.runner != "pooling":
        return None
    from pagedserve.server.loader import load_config
    from pagedserve.server.loader.pooler_config import load_pooler_config

    return load_pooler_config(model_path, load_config(model_path), config.pooler_config)
