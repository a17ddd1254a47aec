"""Prompt -> token ids -> chained block hashes, the router's view of the engines' prefix cache.

The engine caches full KV blocks of ``block_size`` tokens, each found by a hash that chains the parent
block's hash with the block's token ids. The router uses the engine's own function
(common/block_hash.py) so that two prompts sharing a prefix share the hashes of its full blocks and,
under ``--strategy kv-events``, so that the hashes it computes from the engine's published root are the
very hashes the engine reports (router/kv_index.py). Under ``prefix-hash`` the chain's root is a hash of
the model name: only consistency between router processes matters there.

Hashes are ints here (the 16-byte digests read little-endian): stable across processes and machines
(never Python's ``hash()``, which is randomised per process: router replicas must agree without
sharing state).

Nothing here imports torch: the tokenizer is transformers' ``PreTrainedTokenizerFast`` (Rust
``tokenizers`` underneath), never ``AutoTokenizer``, which pulls in torch when it is installed.

Chat templates render as the engine renders them: in the engine server's bounded sandbox
(common/chat_template.py), with the same trust rule for a template sent with the request.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
from array import array
from collections.abc import Sequence
from typing import Any

from pagedserve.common import block_hash
from pagedserve.common.chat_template import ChatTemplateRenderer, TemplateLimits, request_template
from pagedserve.router.segment_cache import SegmentCache

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_CACHE_BYTES = 64 << 20


def hash_int(digest: bytes) -> int:
    """A block hash as the router keeps it (the balancer's ring reads its low 64 bits)."""
    return int.from_bytes(digest, "little")


def seed_hash(model_name: str) -> bytes:
    """The root of every chain under prefix-hash: a hash of the model name."""
    return block_hash.seed_hash(model_name)


def salted_seed(seed: bytes, cache_salt: Any, lora_name: str | None = None) -> bytes:
    """The chain's root for a request, computed as the engine computes it (common/block_hash.py
    ``salted_root``): vLLM's ``cache_salt`` and the LoRA adapter the request names both seed the first
    block, so blocks computed under one adapter, the base model or another salt never share a prefix."""
    return block_hash.salted_root(seed, cache_salt if isinstance(cache_salt, str) else None, lora_name)


def block_hashes(token_ids: Sequence[int], block_size: int, seed: bytes) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``: h_i = H(h_{i-1} || tokens of block i).

    Only full blocks are hashed (the engine caches only full blocks); a prompt shorter than one block
    has no hashes.
    """
    return [hash_int(d) for d in block_hash.chain_hashes(token_ids, block_size, seed)]


# Marks where the template put an image part (private-use code points: no text a client sends has it).
_IMAGE_SENTINEL = "\ue000pagedserve-image\ue000"


def image_content_hash(url: str) -> bytes:
    """What identifies an image part's image: sha256 of a base64 data URI's decoded bytes (so the same
    image sent twice is the same image), else of the URL string (the router never fetches)."""
    header, sep, payload = url.partition(",")
    if sep and header[:5].lower() == "data:" and header.lower().endswith(";base64"):
        try:
            return hashlib.sha256(base64.b64decode(payload, validate=True)).digest()
        except (binascii.Error, ValueError):
            pass  # the engine will refuse it; the string still keys it
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest()


def image_token_ids(digest: bytes, count: int) -> list[int]:
    """``count`` stand-in token ids for one image, drawn from its hash. Negative, so never a real token
    id; ``count`` of a block size makes the block where the image starts a full one, so it is hashed:
    two different images after the same text never share that block's hash, whatever follows them."""
    stream = hashlib.shake_256(digest).digest(8 * count)
    return [~(int.from_bytes(stream[i : i + 8], "little") >> 1) for i in range(0, 8 * count, 8)]


def _image_url(part: Any) -> str | None:
    if isinstance(part, dict) and part.get("type") == "image_url":
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else None
        return url if isinstance(url, str) else None
    return None


def _template_message(message: dict[str, Any], images: list[bytes]) -> dict[str, Any]:
    """A message as the engine hands it to the template (server/api/serving_base.py): text parts joined,
    or, when it has image parts, its parts as a list with ``{"type": "image"}`` for each image, followed
    here by a sentinel text part that marks the image's place in the rendered text. The images' hashes
    are appended to ``images`` in order."""
    content = message.get("content")
    if not isinstance(content, list) or not any(_image_url(part) is not None for part in content):
        return {**message, "content": _text_of(content)}
    parts: list[dict[str, Any]] = []
    for part in content:
        url = _image_url(part)
        if url is not None:
            images.append(image_content_hash(url))
            parts += [{"type": "image"}, {"type": "text", "text": _IMAGE_SENTINEL}]
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
    return {**message, "content": parts}


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
        without adding special tokens again, as the engine does for /v1/chat/completions. Each image
        part stands as ``image_token_ids`` of its content hash where the template placed it."""
        images: list[bytes] = []
        msgs = [_template_message(m, images) if isinstance(m, dict) else m for m in messages]
        if self.tokenizer is not None:
            try:
                text = self.render_chat(msgs, body)
                return self._with_images(text, images) if images else self._encode(text, False)
            except Exception as exc:  # a template that rejects these messages: the engine will answer
                logger.debug("chat template failed (%s); hashing the raw messages", exc)
        ids = self._bytes_of(json.dumps(msgs, ensure_ascii=False, sort_keys=True))
        return ids + [t for digest in images for t in image_token_ids(digest, self.block_size)]

    def _with_images(self, text: str, images: list[bytes]) -> list[int]:
        """Rendered text with one sentinel per image: its pieces tokenized, each image's ids between.
        A template that drops or repeats parts leaves the sentinels astray: the images then go last."""
        pieces = text.split(_IMAGE_SENTINEL)
        stand_ins = [image_token_ids(digest, self.block_size) for digest in images]
        if len(pieces) != len(images) + 1:
            return self._encode("".join(pieces), False) + [t for ids in stand_ins for t in ids]
        ids = self._encode(pieces[0], False)
        for image_ids, piece in zip(stand_ins, pieces[1:], strict=True):
            ids += image_ids
            ids += self._encode(piece, False)
        return ids

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
        return self.hashes_of(ids, body.get("cache_salt")), len(ids)

    def hashes_of(self, token_ids: Sequence[int], cache_salt: Any, lora_name: str | None = None) -> list[int]:
        return block_hashes(token_ids, self.block_size, salted_seed(self.seed, cache_salt, lora_name))


def load_tokenizer(name_or_path: str) -> Any:
    """A fast tokenizer (with its chat template) from a model folder or a hub id, without torch."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(name_or_path)
