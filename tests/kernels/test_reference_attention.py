"""The torch reference's attention variants against a dense oracle built from HF Transformers' own masks.

The reference is the spec the Triton and C++ kernels are tested against, so its sliding window and
soft-capping are checked here against ``transformers.masking_utils`` (``causal_mask_function`` and
``sliding_window_overlay``, what Mistral, Qwen2 and Gemma 2/3 use) and Gemma 2's
``tanh(scores / cap) * cap``, on contexts gathered without paging.
"""

import pytest
import torch
from pagedserve.kernels import reference
from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

from pagedserve.testing.kernels import contexts, hide_blocks_outside_window, make_paged_case

VARIANTS = [
    pytest.param(None, None, id="full"),
    pytest.param(5, None, id="window5"),
    pytest.param(16, None, id="window-one-block"),
    pytest.param(None, 2.5, id="softcap"),
    pytest.param(7, 3.0, id="window-and-softcap"),
]
BLOCK_SIZE = 4
SCALE = 0.25


def dense_oracle(q, case, seq, q_len, sliding_window, logit_softcap):
    """HF-masked attention of ``q`` ``[q_len, H, D]`` (the last q_len positions) over the whole context."""
    context_len = int(case.context_lens[seq])
    num_blocks = -(-context_len // BLOCK_SIZE)
    table = case.block_tables[seq, :num_blocks].long()
    keys = case.k_cache[table].flatten(0, 1)[:context_len]
    values = case.v_cache[table].flatten(0, 1)[:context_len]
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    mask_fn = causal_mask_function
    if sliding_window is not None:
        mask_fn = and_masks(causal_mask_function, sliding_window_overlay(sliding_window))
    q_idx = torch.arange(context_len - q_len, context_len)[:, None]
    kv_idx = torch.arange(context_len)[None, :]
    mask = mask_fn(0, 0, q_idx, kv_idx)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def paged_case(sliding_window, q_lens=None):
    case = make_paged_case(contexts(BLOCK_SIZE, long_blocks=9), 6, 2, 16, BLOCK_SIZE, q_lens=q_lens, seed=7)
    # Blocks no query can see point at NaN, as freed ones point at the null block: they must not be read.
    hidden = case if sliding_window is None else hide_blocks_outside_window(case, sliding_window, q_lens)
    return case, hidden


@pytest.mark.parametrize(("sliding_window", "logit_softcap"), VARIANTS)
def test_decode_matches_hf_masks(sliding_window, logit_softcap):
    case, hidden = paged_case(sliding_window)
    out = reference.paged_attention_decode(
        hidden.q_decode, hidden.k_cache, hidden.v_cache, hidden.block_tables, hidden.context_lens, SCALE,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )
    for seq in range(case.q_decode.shape[0]):
        expected = dense_oracle(case.q_decode[seq:seq + 1], case, seq, 1, sliding_window, logit_softcap)
        torch.testing.assert_close(out[seq:seq + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("sliding_window", "logit_softcap"), VARIANTS)
def test_prefill_matches_hf_masks(sliding_window, logit_softcap):
    # A one-token prompt, a whole prompt, chunks after a cached prefix, a query at the end of a long one.
    q_lens = [1, 2 * BLOCK_SIZE, 7, 1, 7]
    case, hidden = paged_case(sliding_window, q_lens)
    out = reference.paged_attention_prefill(
        hidden.q_prefill, hidden.k_cache, hidden.v_cache, hidden.block_tables, hidden.cu_seqlens_q,
        hidden.context_lens, SCALE, sliding_window=sliding_window, logit_softcap=logit_softcap,
    )
    starts = case.cu_seqlens_q.tolist()
    for seq, q_len in enumerate(q_lens):
        rows = slice(starts[seq], starts[seq + 1])
        expected = dense_oracle(case.q_prefill[rows], case, seq, q_len, sliding_window, logit_softcap)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


def test_a_window_changes_the_answer():
    """The oracle is not blind to the window: a long context attends differently with one."""
    case, _ = paged_case(None)
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, SCALE)
    full, windowed = reference.paged_attention_decode(*args), reference.paged_attention_decode(*args, 5)
    long_seq = 3  # contexts(): long_blocks * block_size + 3 tokens
    assert (full[long_seq] - windowed[long_seq]).abs().max() > 1e-3
    assert torch.equal(full[0], windowed[0])  # one token: nothing to leave out
