"""Prompt -> token ids -> chained block hashes, the router's view of the engines' prefix cache.

The engine caches full KV blocks of ``block_size`` tokens, each found by a hash that chains the parent
block's hash with the block's token ids, seeded by the model name. The router reproduces that chain
(with its own hash function: only consistency between router processes matters) so that two prompts
sharing a prefix share the hashes of its full blocks.

Hashes are 64-bit ints from BLAKE2b, stable across processes and machines (never Python's ``hash()``,
which is randomised per process: router replicas must agree without sharing state).

Nothing here imports torch: the tokenizer is transformers' ``PreTrainedTokenizerFast`` (Rust
``tokenizers`` underneath), never ``AutoTokenizer``, which pulls in torch when it is installed.

Chat templates render as the engine renders them: in the engine server's bounded sandbox
(server/api/chat_template.py), with the same trust rule for a template sent with the request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from collections.abc import Sequence
from typing import Any

from pagedserve.router.segment_cache import SegmentCache
from pagedserve.server.api.chat_template import ChatTemplateRenderer, TemplateLimits, request_template

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
DEFAULT_SEGMENT_CACHE_BYTES = 64 << 20


def seed_hash(model_name: str) -> int:
    """The root of every chain: a 64-bit hash of the model name."""
    return int.from_bytes(hashlib.blake2b(model_name.encode(), digest_size=8).digest(), "little")


def salted_seed(seed: int, cache_salt: Any) -> int:
    """The chain's root for a request with vLLM's ``cache_salt``: the engine salts its first block's
    hash with it (server/core/kv_cache_manager.py), so different salts share no cached prefix."""
    if not isinstance(cache_salt, str) or not cache_salt:
        return seed
    data = (seed & _MASK64).to_bytes(8, "little") + cache_salt.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``: h_i = H(h_{i-1} || tokens of block i).

    Only full blocks are hashed (the engine caches only full blocks); a prompt shorter than one block
    has no hashes.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    # One contiguous buffer of uint32 (or uint64 for huge vocabularies); block i is a byte slice of it.
    try:
        buf = array("I", token_ids[: n_full * block_size]).tobytes()
        width = 4
    except OverflowError:
        buf = array("Q", token_ids[: n_full * block_size]).tobytes()
        width = 8
    step = block_size * width
    blake = hashlib.blake2b
    out: list[int] = []
    parent = (seed & _MASK64).to_bytes(8, "little")
    for i in range(n_full):
        digest = blake(parent + buf[i * step : (i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        parent = digest
    return out


def _text_of(content: Any) -> Any:
    """OpenAI content parts -> plain text (text parts joined); other shapes pass through."""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return content


class PromptHasher:
    """Turns an OpenAI request body into the chained block hashes of its prompt.

    ``tokenizer``: a model folder or hub id (loaded with ``PreTrainedTokenizerFast``), or None. Without
    a tokenizer the prompt's UTF-8 bytes stand in for tokens (blocks of ``4 * block_size`` bytes, about
    the same text per block): prefix affinity still works, only the block boundaries differ from the
    engine's.
    """

    def __init__(
        self,
        tokenizer: str | None,
        model_name: str,
        block_size: int = 16,
        segment_cache_bytes: int = DEFAULT_SEGMENT_CACHE_BYTES,
        trust_request_chat_template: bool = False,
        template_limits: TemplateLimits | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.model_name = model_name
        self.seed = seed_hash(model_name)
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer else None
        self._backend = None
        self._templates: ChatTemplateRenderer | None = None
        self._split = None  # regex splitting rendered text at added tokens, when that is exact
        self._special_ids: dict[str, int] = {}
        self.segments = SegmentCache(segment_cache_bytes)  # token ids of the text between added tokens
        if self.tokenizer is not None:
            self._backend = getattr(self.tokenizer, "_tokenizer", None)  # the Rust tokenizers.Tokenizer
            self._templates = ChatTemplateRenderer.for_tokenizer(
                self.tokenizer,
                trust_request_templates=trust_request_chat_template,
                limits=template_limits or TemplateLimits(),
            )
            self._setup_fast_paths()

    # --- fast paths, each checked against the reference on a probe conversation ------------------
    def _setup_fast_paths(self) -> None:
        probes = [
            [
                {"role": "system", "content": "You are a careful assistant. Answer briefly, in English."},
                {"role": "user", "content": "Hello there!  What's 2 + 2?\nThanks."},
                {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "And 3 + 3 ?"},
            ],
            # Some templates refuse system messages.
            [
                {"role": "user", "content": "Hello there!  What's 2 + 2?\nThanks."},
                {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "And 3 + 3 ?"},
            ],
        ]
        reference = None
        for probe in probes:
            try:
                reference = self.render_chat(probe)
                break
            except Exception:
                continue
        # Tokenize the rendered text piecewise between added tokens, caching the pieces (a long system
        #    prompt is tokenized once). The tokenizer itself splits at added tokens before anything else,
        #    so this is exact whenever no added token strips whitespace or needs normalization.
        backend = self._backend
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return
        try:
            added = backend.get_added_tokens_decoder()
            if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
                return
            self._special_ids = {t.content: i for i, t in added.items()}
            if not self._special_ids:
                return
            alternatives = sorted(self._special_ids, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")
            text = reference if reference is not None else "<|probe|> hello  world\n"
            if self._encode_pieces(text) != backend.encode(text, add_special_tokens=False).ids:
                self._split = None
            self.segments.clear()
        except Exception as exc:  # pragma: no cover - older tokenizers without the API
            logger.debug("piecewise tokenization unavailable: %s", exc)
            self._split = None

    def _encode_pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self.segments
        special = self._special_ids
        encode = self._backend.encode
        for i, piece in enumerate(self._split.split(text)):
            if not piece:
                continue
            if i % 2:  # the separators, i.e. the added tokens
                ids.append(special[piece])
                continue
            cached = cache.get(piece)
            if cached is None:
                cached = cache.put(piece, encode(piece, add_special_tokens=False).ids)
            ids.extend(cached)
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if not add_special_tokens and self._split is not None:
            return self._encode_pieces(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)  # pragma: no cover

    def render_chat(self, messages: list[dict[str, Any]], body: dict[str, Any] | None = None) -> str:
        """The chat template applied as the engine applies it (server/api/serving_base.py).

        A template sent with the request renders only with ``--trust-request-chat-template``; else this
        raises and the caller hashes the raw messages. The router does not answer that request itself:
        whether request templates are trusted is the engine's decision, as in vLLM (its 400 reaches the
        client unchanged), and the router runs no template it was not told to trust.
        """
        body = body or {}
        kwargs = body.get("chat_template_kwargs")
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        assert self._templates is not None, "render_chat needs a tokenizer"
        return self._templates.render(
            messages,
            request_template=request_template(body.get("chat_template"), kwargs),
            tools=body.get("tools") or None,
            documents=body.get("documents"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            kwargs=kwargs,
        )

    # --- prompt -> token ids ---------------------------------------------------------------------
    def chat_token_ids(self, messages: list[dict[str, Any]], body: dict[str, Any] | None = None) -> list[int]:
        """Chat messages rendered with the chat template (generation prompt added), then tokenized
        without adding special tokens again, as the engine does for /v1/chat/completions."""
        msgs = [{**m, "content": _text_of(m.get("content"))} if isinstance(m, dict) else m for m in messages]
        if self.tokenizer is not None:
            try:
                return self._encode(self.render_chat(msgs, body), False)
            except Exception as exc:  # a template that rejects these messages: the engine will answer
                logger.debug("chat template failed (%s); hashing the raw messages", exc)
        return self._bytes_of(json.dumps(msgs, ensure_ascii=False, sort_keys=True))

    def text_token_ids(self, prompt: str) -> list[int]:
        if self.tokenizer is not None:
            return self._encode(prompt, True)
        return self._bytes_of(prompt)

    def _bytes_of(self, text: str) -> list[int]:
        # 4 bytes per "token" so that a block covers about as much text as one of real tokens.
        data = text.encode("utf-8", "surrogatepass")
        return list(array("I", data[: len(data) // 4 * 4]))

    def token_ids_for(self, path: str, body: Any) -> list[int] | None:
        """Token ids of the prompt of a /v1/chat/completions or /v1/completions body, else None."""
        if not isinstance(body, dict):
            return None
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if isinstance(messages, list) and messages:
                return self.chat_token_ids(messages, body)
            return None
        if path.endswith("/completions"):
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt:  # a batch: route on its first prompt
                first = prompt[0]
                if isinstance(first, int):
                    return [int(t) for t in prompt if isinstance(t, int)]
                prompt = first
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if isinstance(prompt, str) and prompt:
                return self.text_token_ids(prompt)
        return None

    def hashes_for(self, path: str, body: Any) -> tuple[list[int], int]:
        """(block hashes, number of prompt tokens) of a request body; ([], 0) if it has no prompt."""
        ids = self.token_ids_for(path, body)
        if not ids:
            return [], 0
        seed = salted_seed(self.seed, body.get("cache_salt"))
        return block_hashes(ids, self.block_size, seed), len(ids)


def load_tokenizer(name_or_path: str) -> Any:
    """A fast tokenizer (with its chat template) from a model folder or a hub id, without torch."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(name_or_path)
