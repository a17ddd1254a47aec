"""Flattens one scheduled step into a single token batch and runs the model over the paged KV cache.

Decodes (one new token each) come first, then prefill chunks, as ``AttentionMetadata`` expects. Only
requests whose chunk reaches their last known token are sampled; a partial prompt chunk just fills
its blocks, and gives its positions' prompt logprobs to a request that asked for them
(server/worker/prompt_logprobs.py appends those to ``Request.prompt_logprobs``). The grammar bitmask of
the sampled requests is filled once the forward pass is launched (server/structured_output/bitmask.py).
A decode with draft tokens runs as one decode row per position (the last known token, then the drafts),
each attending to the cache up to itself: the same decode kernel over the same blocks as a decode without
drafts, so the target's logits at each position are bit for bit those it would compute one token at a
time (a prefill chunk sums in another order, which quantized activations amplify into other greedy
tokens); server/spec_decode/rejection_sampler.py keeps the drafts the target agrees with.
KV moved by connectors (the CPU KV tier, prefill/decode disaggregation) is not the runner's: their workers
(server/worker/kv_connector_workers.py) make a step's transfers before it is launched. With a draft model
(server/spec_decode/draft_model.py) the runner first fills the step's pending drafts with it, then mirrors
the target's forward pass over the drafter's own layers (its KV in the same slots), and hands its draw
distributions to the verifier.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from pagedserve.server.backend import Backend
from pagedserve.server.core.scheduler import ScheduledRequest
from pagedserve.server.layers.attention import AttentionMetadata, allocate_kv_caches
from pagedserve.server.lora.manager import LoRAManager
from pagedserve.server.multimodal import ImageInput
from pagedserve.server.outputs import SampledToken
from pagedserve.server.request import Request
from pagedserve.server.sample.sampler import LaunchedSample, launch_sample
from pagedserve.server.spec_decode.draft_model import DraftModel
from pagedserve.server.spec_decode.rejection_sampler import verify_drafts
from pagedserve.server.structured_output.bitmask import fill_grammar_bitmask
from pagedserve.server.worker.block_table import BlockTable
from pagedserve.server.worker.cuda_graphs import DecodeGraphs
from pagedserve.server.worker.pooler import PoolingRows, pool
from pagedserve.server.worker.prompt_logprobs import (
    PromptLogprobRows,
    prompt_logprob_rows,
    record_prompt_logprobs,
)
from torch import nn


class OtherRanks(Protocol):
    """The other tensor-parallel ranks as the runner drives them (server/executor/tp_driver.py TPDriver):
    each model call is announced to them before rank 0 makes it, so that their collectives meet."""

    def forward(self, inputs: ModelInputs) -> None: ...

    def logits(self, hidden: torch.Tensor) -> None: ...


@dataclass
class ModelInputs:
    """What the forward pass of a step reads; under tensor parallelism rank 0 sends it whole to every
    other rank (server/executor/tp_driver.py), so a per-step input added here reaches them all."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # The rows' embeddings when some rows are image features (server/multimodal.py); else None, and the
    # model embeds input_ids itself
    inputs_embeds: torch.Tensor | None = None


@dataclass
class StepInputs:
    model: ModelInputs
    sample_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    sampled_requests: list[Request]
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # Decodes with drafts: hidden rows of the last known token and of each draft, request after request
    spec_indices: list[int] = field(default_factory=list)
    spec_requests: list[ScheduledRequest] = field(default_factory=list)
    ordered: list[ScheduledRequest] = field(default_factory=list)  # the batch's order: decodes, prefills
    # A sampling draft model's distributions per request id (server/spec_decode/draft_model.py)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    pooling_rows: list[PoolingRows] = field(default_factory=list)  # pooling requests' chunks
    # Rows of image placeholders: (first row, the request, its image's index, the run's part [first, last))
    image_rows: list[tuple[int, Request, int, int, int]] = field(default_factory=list)

StepResult = list[tuple[Request, list[SampledToken] | Exception]]


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued on the device: ``result`` reads its tokens back.
    Until then the next step may be launched, its inputs taken from ``sample.device_token_ids``
    (async scheduling, server/engine/core.py)."""

    sampled_requests: list[Request]
    sample: LaunchedSample | None
    spec_results: StepResult = field(default_factory=list)  # verified drafts: on the host already
    # Pooling requests whose prompt ended this step, and their vectors (on the device until ``result``)
    pooled: list[tuple[Request, torch.Tensor]] = field(default_factory=list)

    @property
    def device_token_ids(self) -> torch.Tensor | None:
        return self.sample.device_token_ids if self.sample is not None else None

    def row_of(self) -> dict[str, int]:
        """Each sampled request's row of ``device_token_ids``."""
        return {r.request_id: row for row, r in enumerate(self.sampled_requests)}

    def result(self) -> StepResult:
        """Each sampled request's new tokens, or the exception its row alone raised; a pooling request
        whose prompt ended gets no token, its vector in ``Request.pooled``."""
        results: StepResult = []
        if self.sample is not None:
            sampled = self.sample.result(self.sampled_requests)
            results = [(r, t if isinstance(t, Exception) else [t])
                       for r, t in zip(self.sampled_requests, sampled, strict=True)]
        for request, vector in self.pooled:
            request.pooled = vector.tolist()
            results.append((request, []))
        return results + self.spec_results


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: Backend,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        enforce_eager: bool = False,
        calculate_kv_scales: bool = False,
        lora: LoRAManager | None = None,
        ranks: OtherRanks | None = None,
        draft_model: nn.Module | None = None,
    ) -> None:
        """``dtype``: the KV cache's (``EngineConfig.torch_kv_cache_dtype``), which may be FP8 while the
        model computes in another. ``calculate_kv_scales``: the first prefill after start-up sets each
        layer's FP8 scales (server/layers/attention.py); armed after graph capture, whose dummy steps
        must not set them. ``lora``: the adapters' slots (server/lora/manager.py); the runner sets the
        step's token -> slot mapping, and the engine runs such a model without CUDA graphs. ``ranks``:
        the other tensor-parallel ranks (server/executor/tp_driver.py), told of every model call first;
        None on one rank. ``draft_model``: the
        speculative drafter, given a cache of the same blocks (server/spec_decode/draft_model.py)."""
        if model.backend is not backend:  # its layers run model.backend's kernels, graphs or not
            raise ValueError(f"the model was built for the {model.backend.name} backend, not {backend.name}")
        self.model = model
        self.lora = lora
        self.ranks = ranks
        self.block_size = block_size
        self.device = device
        self.block_table = BlockTable(max_num_seqs, -(-max_model_len // block_size), device,
                                      None if device.type == "cpu" else self._to_device)
        allocate_kv_caches(model.attention_layers(), num_blocks, block_size, dtype, device)
        self.drafter: DraftModel | None = None
        if draft_model is not None:
            self.drafter = DraftModel(draft_model, num_blocks, block_size, dtype, device)
        # Each image's encoder features while a request holds them (``Request.mm_features``), by hash: a
        # repeated image is encoded once, and the entries leave with the last request that holds them.
        self.encoder_cache: weakref.WeakValueDictionary[bytes, torch.Tensor] = weakref.WeakValueDictionary()
        self.graphs: DecodeGraphs | None = None
        if backend.supports_cuda_graphs and not enforce_eager:
            self.graphs = DecodeGraphs(model, backend, max_num_seqs, max_model_len, block_size, device)
            self.graphs.capture()
        for layer in model.attention_layers():
            layer.calculate_kv_scales = calculate_kv_scales

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()  # 1 for FP8: twice a 16-bit cache's blocks
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @torch.inference_mode()
    def launch(
        self,
        scheduled: list[ScheduledRequest],
        block_ids: dict[str, list[int]],
        active_loras: set[int] | None = None,
        previous: LaunchedStep | None = None,
    ) -> LaunchedStep:
        """One forward pass and its sampling, queued; ``LaunchedStep.result`` reads back each sampled
        request's new tokens (one, or the accepted drafts and one more), or the exception its row alone
        raised. ``active_loras``: the adapters of every running request, whose device slots this step must
        not take. ``previous``: the step still in
        flight, whose sampled tokens are the inputs of this step's rows with ``num_in_flight``."""
        draft_probs = self._draft(scheduled, block_ids) if self.drafter is not None else {}
        inputs = self.prepare(scheduled, block_ids, previous)
        if inputs.image_rows:
            inputs.model.inputs_embeds = self._merge_images(inputs.model.input_ids, inputs.image_rows)
        inputs.draft_probs = draft_probs
        if self.lora is not None:
            self._set_lora_mapping(inputs.ordered, active_loras or set())
        if self.ranks is not None:
            self.ranks.forward(inputs.model)
        hidden = self.run_model(inputs.model)
        if self.drafter is not None:
            self.drafter.mirror(inputs.model.input_ids, inputs.model.positions, inputs.model.meta)
        # After the launch: on a GPU the matchers' CPU work overlaps the forward pass.
        grammar = fill_grammar_bitmask(inputs.sampled_requests)
        if grammar is not None:
            grammar.bits = self._to_device(grammar.bits)
        for rows in inputs.prompt_logprob_rows:
            record_prompt_logprobs(self.compute_logits, hidden, rows)
        launched = LaunchedStep(inputs.sampled_requests, None)
        for rows in inputs.pooling_rows:
            if (vector := pool(hidden, rows)) is not None:
                launched.pooled.append((rows.request, vector))
        if inputs.sampled_requests:
            logits = self.compute_logits(hidden.index_select(0, inputs.sample_indices))
            launched.sample = launch_sample(logits, inputs.sampled_requests, grammar)
        if inputs.spec_requests:
            launched.spec_results = self._verify(hidden, inputs)
        return launched

    def run_model(self, inputs: ModelInputs) -> torch.Tensor:
        """This rank's forward pass over a step (every rank runs it, rank 0 after telling the others)."""
        if self.graphs is not None and inputs.inputs_embeds is None and self.graphs.fits(inputs.meta):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.inputs_embeds)

    def _merge_images(self, input_ids: torch.Tensor, image_rows: list[tuple[int, Request, int, int, int]],
                      ) -> torch.Tensor:
        """The step's embeddings: the tokens', with each image run's rows replaced by its features."""
        embeds = self.model.embed_input_ids(input_ids)
        for row, request, index, first, last in image_rows:
            features = self._image_features(request, index)
            embeds[row : row + last - first] = features[first:last].to(embeds.dtype)
        return embeds

    def _image_features(self, request: Request, index: int) -> torch.Tensor:
        """One image's encoder features, made on its request's first step that reaches its run."""
        features = request.mm_features.get(index)
        if features is not None:
            return features
        image: ImageInput = request.mm_inputs[index]
        features = self.encoder_cache.get(image.hash)
        if features is None:
            inputs = {name: self._to_device(value) for name, value in image.encoder_inputs.items()}
            features = self.model.encode_images(**inputs)
            if features.shape[0] != image.length:
                raise ValueError(f"the image encoder gave {features.shape[0]} features for an image of "
                                 f"{image.length} placeholder tokens")
            self.encoder_cache[image.hash] = features
        request.mm_features[index] = features
        return features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of ``hidden``'s rows, the other ranks' vocabulary slices gathered here."""
        if self.ranks is not None:
            self.ranks.logits(hidden)
        return self.model.compute_logits(hidden)

    def _set_lora_mapping(self, ordered: list[ScheduledRequest], active_loras: set[int]) -> None:
        """Each token's adapter slot (-1: the base model), in the flattened batch's order; None when the
        step has no adapter, so the projections skip LoRA."""
        assert self.lora is not None
        lora_ids = [item.request.lora_int_id for item in ordered]
        if not any(lora_ids):
            self.lora.set_token_slots(None)
            return
        slot_of = self.lora.activate([i for i in lora_ids if i], active_loras)
        slots = torch.tensor([slot_of.get(i, -1) if i else -1 for i in lora_ids], dtype=torch.long)
        counts = torch.tensor([item.num_new_tokens for item in ordered], dtype=torch.long)
        self.lora.set_token_slots(self._to_device(slots.repeat_interleave(counts)))

    def _draft(self, scheduled: list[ScheduledRequest],
               block_ids: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """The drafter's tokens for the step's pending drafts (their slots are allocated already)."""
        assert self.drafter is not None
        pending = [s for s in scheduled if s.spec_token_ids]
        if not pending:
            return {}
        rows = self.block_table.update([s.request.request_id for s in pending], block_ids)
        return self.drafter.propose(pending, self.block_table.host_rows(rows), self._to_device)

    def _verify(self, hidden: torch.Tensor, inputs: StepInputs) -> StepResult:
        spec_rows = self._to_device(torch.tensor(inputs.spec_indices, dtype=torch.long))
        logits = self.compute_logits(hidden.index_select(0, spec_rows))
        results: StepResult = []
        first = 0
        for item in inputs.spec_requests:
            rows = logits[first:first + len(item.spec_token_ids) + 1]
            first += rows.shape[0]
            try:
                q = inputs.draft_probs.get(item.request.request_id)
                results.append((item.request, verify_drafts(rows, item.request, item.spec_token_ids, q)))
            except Exception as exc:  # this request's rows: it fails alone, as in sample_each
                results.append((item.request, exc))
        return results

    def prepare(self, scheduled: list[ScheduledRequest], block_ids: dict[str, list[int]],
                previous: LaunchedStep | None = None) -> StepInputs:
        """The step's inputs. A row whose token is still being sampled by ``previous`` (the step in flight,
        ``ScheduledRequest.num_in_flight``) takes it from there on the device."""
        decodes = [s for s in scheduled if s.num_new_tokens == 1 or s.spec_token_ids]
        prefills = [s for s in scheduled if s.num_new_tokens > 1 and not s.spec_token_ids]
        if self.lora is not None:  # each adapter's tokens in one run per kind: kernels/cpu.py _SlotRuns
            decodes.sort(key=_adapter_of)
            prefills.sort(key=_adapter_of)
        ordered = decodes + prefills
        token_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # each token's row of the step's block tables
        table_items: list[int] = []  # each row's request (its index in ``ordered``): per decode token,
        context_lens: list[int] = []  # then per prefill chunk; and its context length
        sample_indices: list[int] = []
        sampled: list[Request] = []
        spec_indices: list[int] = []
        spec_requests: list[ScheduledRequest] = []
        prompt_rows: list[PromptLogprobRows] = []
        pooling: list[PoolingRows] = []
        image_rows: list[tuple[int, Request, int, int, int]] = []
        mrope_rows: list[tuple[int, int, int, Request]] = []  # (first row, start, end) of 3-D positions
        in_flight_rows: list[int] = []  # rows whose token ``previous`` is sampling, and their requests
        in_flight_ids: list[str] = []
        num_decode_items = len(decodes)
        for index, item in enumerate(ordered):
            request, start = item.request, item.request.num_computed_tokens + item.num_in_flight
            if (item.num_new_tokens == 1 and not item.spec_token_ids and request.prompt_logprobs is None
                    and request.pooling is None
                    and not (request.mm_inputs and start < request.num_prompt_tokens)):
                # One token and nothing else to do: most rows of a step, so kept to the bare appends.
                rows.append(len(table_items))
                table_items.append(index)
                context_lens.append(start + 1)
                num_prompt, num_output = len(request.prompt_token_ids), len(request.output_token_ids)
                if start < num_prompt:
                    token_ids.append(request.prompt_token_ids[start])
                elif start < num_prompt + num_output:
                    token_ids.append(request.output_token_ids[start - num_prompt])
                else:
                    in_flight_rows.append(len(token_ids))
                    in_flight_ids.append(request.request_id)
                    token_ids.append(0)  # filled in on the device, below
                positions.append(start)
                if request.mrope_positions is not None:
                    mrope_rows.append((len(token_ids) - 1, start, start + 1, request))
                if start + 1 == num_prompt + num_output + item.num_in_flight:
                    sample_indices.append(len(token_ids) - 1)
                    sampled.append(request)
                continue
            end = start + item.num_new_tokens
            if index < num_decode_items:  # a row per token, attending up to itself
                rows.extend(range(len(table_items), len(table_items) + item.num_new_tokens))
                table_items.extend([index] * item.num_new_tokens)
                context_lens.extend(range(start + 1, end + 1))
            else:
                rows.extend([len(table_items)] * item.num_new_tokens)
                table_items.append(index)
                context_lens.append(end)
            if (wanted := prompt_logprob_rows(request, len(token_ids), start, end)) is not None:
                prompt_rows.append(wanted)
            if request.pooling is not None:
                pooling.append(PoolingRows(request, len(token_ids), start, end - start))
            if request.mrope_positions is not None:
                mrope_rows.append((len(token_ids), start, end, request))
            for image_index, image in enumerate(request.mm_inputs):
                if (part := image.rows_in(start, end)) is not None:
                    row = len(token_ids) + image.offset + part[0] - start
                    image_rows.append((row, request, image_index, *part))
            num_drafts = len(item.spec_token_ids)
            token_ids.extend(request.token_slice(start, end - num_drafts))
            token_ids.extend(item.spec_token_ids)
            positions.extend(range(start, end))
            if num_drafts:
                spec_indices.extend(range(len(token_ids) - num_drafts - 1, len(token_ids)))
                spec_requests.append(item)
            elif item.completes_sequence and request.pooling is None:
                sample_indices.append(len(token_ids) - 1)
                sampled.append(request)
        # Each row's and each token's row of the persistent table (server/worker/block_table.py)
        item_rows = self.block_table.update([item.request.request_id for item in ordered], block_ids)
        table_rows = item_rows[np.array(table_items, dtype=np.int64)]
        position_np = np.array(positions, dtype=np.int64)
        block_of_token = self.block_table.block_of(table_rows[np.array(rows, dtype=np.int64)], position_np,
                                                   self.block_size)
        slot_mapping = torch.from_numpy(block_of_token * self.block_size + position_np % self.block_size)
        table_t = self.block_table.device_rows(table_rows)
        num_decodes = sum(s.num_new_tokens for s in decodes)
        prefill_lens = [s.num_new_tokens for s in prefills]
        cu_seqlens = torch.tensor([0, *prefill_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        lens_t = torch.tensor(context_lens, dtype=torch.int32)
        to = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to(slot_mapping),
            num_decode_tokens=num_decodes,
            decode_block_tables=table_t[:num_decodes],
            decode_context_lens=to(lens_t[:num_decodes]),
            prefill_block_tables=table_t[num_decodes:],
            prefill_cu_seqlens_q=to(cu_seqlens),
            prefill_context_lens=to(lens_t[num_decodes:]),
        )
        input_ids = to(torch.tensor(token_ids, dtype=torch.long))
        if in_flight_rows:
            assert previous is not None and previous.device_token_ids is not None
            row_of = previous.row_of()
            sources = [row_of[request_id] for request_id in in_flight_ids]
            input_ids[to(torch.tensor(in_flight_rows))] = previous.device_token_ids[to(torch.tensor(sources))]
        rope_positions = position_np
        if self.model.uses_mrope:  # [3, T]: text rows' three positions are their index
            rope_positions = np.tile(position_np, (3, 1))
            for row, first, last, request in mrope_rows:
                rope_positions[:, row : row + last - first] = _mrope_positions(request, first, last)
        return StepInputs(
            model=ModelInputs(input_ids, to(torch.from_numpy(rope_positions)), meta),
            sample_indices=to(torch.tensor(sample_indices, dtype=torch.long)),
            sampled_requests=sampled,
            prompt_logprob_rows=prompt_rows,
            pooling_rows=pooling,
            image_rows=image_rows,
            spec_indices=spec_indices,
            spec_requests=spec_requests,
            ordered=ordered,
        )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)


def _mrope_positions(request: Request, first: int, last: int) -> np.ndarray:
    """The rotary positions ``[3, last - first]`` of a multimodal-RoPE request's positions: its prompt's
    as the front end computed them, then each index plus the request's offset (server/multimodal.py)."""
    assert request.mrope_positions is not None
    out = np.empty((3, last - first), dtype=np.int64)
    prompt_end = min(last, request.num_prompt_tokens)
    if first < prompt_end:
        out[:, : prompt_end - first] = request.mrope_positions[:, first:prompt_end].numpy()
    generated = max(first, request.num_prompt_tokens)
    if generated < last:
        out[:, generated - first :] = np.arange(generated, last) + request.mrope_delta
    return out


def _adapter_of(item: ScheduledRequest) -> int:
    return item.request.lora_int_id


