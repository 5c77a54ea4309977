"""Reference paged attention: equal to dense causal attention; batch and chunk invariant bitwise.

No megatron-core needed: the kernels are called directly with flash-attn's arguments.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.cpu_backend.attention import (
    attend_sequence,
    fa_version_answer,
    full_sequence_attention,
    kvcache_attention,
    varlen_attention,
)

BLOCK = 4  # tokens per block: small, so sequences span several blocks with partial last ones
NUM_BLOCKS = 24
MAX_BLOCKS = 5  # block-table width
D = 8


def dense_attention(q, k, v, scale, window=(-1, -1)):
    """Float64 causal attention, bottom-right aligned, written out directly.

    q [Lq, H, D], k/v [Lk, Hkv, D] -> (out [Lq, H, D] float64, lse [H, Lq] float64).
    """
    q, k, v = q.double(), k.double(), v.double()
    seqlen_q, heads, _ = q.shape
    seqlen_k, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos_q = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    pos_k = torch.arange(seqlen_k)[None, :]
    visible = pos_k <= pos_q
    if window[0] >= 0:
        visible &= pos_k >= pos_q - window[0]
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse


class PagedBatch:
    """Several sequences written into one paged cache at scattered blocks.

    Every cache slot no sequence owns holds NaN, so reading one shows up in the output.
    """

    def __init__(self, kv_lengths, q_lengths, heads=4, kv_heads=2, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.kv_lengths, self.q_lengths = list(kv_lengths), list(q_lengths)
        self.k_cache = torch.full((NUM_BLOCKS, BLOCK, kv_heads, D), math.nan, dtype=dtype)
        self.v_cache = torch.full((NUM_BLOCKS, BLOCK, kv_heads, D), math.nan, dtype=dtype)
        self.block_table = torch.full((len(kv_lengths) + 1, MAX_BLOCKS), -1, dtype=torch.int32)
        free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        self.keys, self.values, self.queries = [], [], []
        for i, (lk, lq) in enumerate(zip(kv_lengths, q_lengths)):
            k = torch.randn(lk, kv_heads, D, generator=gen).to(dtype)
            v = torch.randn(lk, kv_heads, D, generator=gen).to(dtype)
            self.keys.append(k)
            self.values.append(v)
            self.queries.append(torch.randn(lq, heads, D, generator=gen).to(dtype))
            for j in range(-(-lk // BLOCK)):
                block = free.pop()
                self.block_table[i, j] = block
                n = min(BLOCK, lk - j * BLOCK)
                self.k_cache[block, :n] = k[j * BLOCK:j * BLOCK + n]
                self.v_cache[block, :n] = v[j * BLOCK:j * BLOCK + n]

    def varlen_args(self, padding_tokens=3):
        """Packed q with trailing padding rows, plus a padded request (length 0, all -1 blocks)."""
        q = torch.cat(self.queries + [torch.full_like(self.queries[0][:1], 7.0)] * padding_tokens)
        cu_q = torch.tensor([0] + self.q_lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + self.kv_lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
        cu_q = torch.cat([cu_q, cu_q[-1:]])  # padded request: zero query and key tokens
        cu_k = torch.cat([cu_k, cu_k[-1:]])
        return q, cu_q, cu_k


def _run_varlen(batch, **kwargs):
    q, cu_q, cu_k = batch.varlen_args()
    return varlen_attention(q, batch.k_cache, batch.v_cache, cu_q, cu_k, max(batch.q_lengths),
                            max(batch.kv_lengths), causal=True, block_table=batch.block_table,
                            **kwargs)


KV_LENGTHS = [7, 12, 1, 9, 16]
Q_LENGTHS = [7, 5, 1, 3, 16]  # full prefill, prefix-cached tail, single token, chunk, two blocks


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_varlen_matches_dense_causal_attention(heads, kv_heads, scale):
    batch = PagedBatch(KV_LENGTHS, Q_LENGTHS, heads=heads, kv_heads=kv_heads)
    out, lse, probs = _run_varlen(batch, softmax_scale=scale, return_attn_probs=True)
    assert probs is None
    assert out.shape == (sum(Q_LENGTHS) + 3, heads, D) and out.dtype == torch.float32
    start = 0
    for q, k, v in zip(batch.queries, batch.keys, batch.values):
        ref_out, ref_lse = dense_attention(q, k, v, D ** -0.5 if scale is None else scale)
        rows = slice(start, start + q.shape[0])
        torch.testing.assert_close(out[rows].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, rows].double(), ref_lse, rtol=1e-5, atol=1e-5)
        start += q.shape[0]
    assert torch.equal(out[start:], torch.zeros_like(out[start:]))  # padding rows
    assert torch.isinf(lse[:, start:]).all()


def test_varlen_bf16_matches_dense_within_bf16_rounding():
    batch = PagedBatch(KV_LENGTHS, Q_LENGTHS, dtype=torch.bfloat16)
    out = _run_varlen(batch)
    assert out.dtype == torch.bfloat16
    start = 0
    for q, k, v in zip(batch.queries, batch.keys, batch.values):
        ref, _ = dense_attention(q, k, v, D ** -0.5)
        torch.testing.assert_close(out[start:start + q.shape[0]].double(), ref,
                                   rtol=1e-2, atol=1e-2)
        start += q.shape[0]


def test_varlen_sliding_window():
    batch = PagedBatch(KV_LENGTHS, Q_LENGTHS)
    out = _run_varlen(batch, window_size=(3, 0))
    start = 0
    for q, k, v in zip(batch.queries, batch.keys, batch.values):
        ref, _ = dense_attention(q, k, v, D ** -0.5, window=(3, 0))
        torch.testing.assert_close(out[start:start + q.shape[0]].double(), ref,
                                   rtol=1e-5, atol=1e-5)
        start += q.shape[0]


def test_varlen_without_block_table_reads_packed_keys():
    batch = PagedBatch(KV_LENGTHS, Q_LENGTHS)
    q, cu_q, cu_k = batch.varlen_args()
    out = varlen_attention(q, torch.cat(batch.keys), torch.cat(batch.values), cu_q, cu_k,
                           16, 16, causal=True)
    assert torch.equal(out, _run_varlen(batch))


def test_kvcache_decode_matches_dense():
    batch = PagedBatch(KV_LENGTHS, [1] * len(KV_LENGTHS))
    q = torch.stack(batch.queries)  # [B, 1, H, D]
    seqlens = torch.tensor(KV_LENGTHS, dtype=torch.int32)
    out, lse = kvcache_attention(q, batch.k_cache, batch.v_cache, cache_seqlens=seqlens,
                                 block_table=batch.block_table[:len(KV_LENGTHS)], causal=True,
                                 return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (len(KV_LENGTHS), 4, 1)
    for i, (k, v) in enumerate(zip(batch.keys, batch.values)):
        ref_out, ref_lse = dense_attention(batch.queries[i], k, v, D ** -0.5)
        torch.testing.assert_close(out[i].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[i].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_kvcache_with_more_query_rows_than_sequences():
    """megatron-core 0.17 sends a mixed step whose requests all have one query token to the
    decode kernel with the step's padded token rows: only the first len(cache_seqlens) rows are
    sequences, the rest (and sequences of length 0) come back zero."""
    batch = PagedBatch(KV_LENGTHS[:3], [1, 1, 1])
    seqlens = torch.tensor(KV_LENGTHS[:3] + [0], dtype=torch.int32)  # one padded request
    q = torch.cat([torch.stack(batch.queries), torch.ones(4, 1, 4, D)])  # 7 token rows
    out = kvcache_attention(q, batch.k_cache, batch.v_cache, cache_seqlens=seqlens,
                            block_table=batch.block_table[:4], causal=True)
    alone = kvcache_attention(q[:3], batch.k_cache, batch.v_cache, cache_seqlens=seqlens[:3],
                              block_table=batch.block_table[:3], causal=True)
    assert torch.equal(out[:3], alone)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


def test_request_alone_equals_request_in_batch_bitwise():
    batch = PagedBatch(KV_LENGTHS, Q_LENGTHS)
    out = _run_varlen(batch)
    start = 0
    for i, q in enumerate(batch.queries):
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        cu_k = torch.tensor([0, KV_LENGTHS[i]], dtype=torch.int32)
        alone = varlen_attention(q, batch.k_cache, batch.v_cache, cu_q, cu_k, q.shape[0],
                                 KV_LENGTHS[i], causal=True, block_table=batch.block_table[i:i + 1])
        assert torch.equal(alone, out[start:start + q.shape[0]]), f"request {i}"
        start += q.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_output_independent_of_how_many_query_tokens_share_the_step(dtype):
    """Full prefill, a prefix-cached tail and a decode step give the same bits for a token:
    what makes prefix caching on and off comparable bit for bit."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(13, 2, D, generator=gen).to(dtype)
    v = torch.randn(13, 2, D, generator=gen).to(dtype)
    q = torch.randn(13, 4, D, generator=gen).to(dtype)
    full, _ = attend_sequence(q, k, v, D ** -0.5)
    for start in (1, 5, 8, 12):
        tail, _ = attend_sequence(q[start:], k, v, D ** -0.5)
        assert torch.equal(tail, full[start:]), f"tail from {start}"
    for end in (1, 4, 9):  # decode step of token end-1 with only end keys cached
        step, _ = attend_sequence(q[end - 1:end], k[:end], v[:end], D ** -0.5)
        assert torch.equal(step[0], full[end - 1]), f"decode at {end}"


def test_missing_block_for_cached_tokens_raises():
    batch = PagedBatch([9], [9])
    batch.block_table[0, 2] = -1  # token 8 lives in block 2
    with pytest.raises(ValueError, match="lacks a valid block"):
        _run_varlen(batch)


@pytest.mark.parametrize("feature", [{"dropout_p": 0.1}, {"softcap": 30.0},
                                     {"alibi_slopes": torch.ones(4)}])
def test_unsupported_varlen_features_raise(feature):
    with pytest.raises(NotImplementedError):
        _run_varlen(PagedBatch([4], [4]), **feature)


def test_kvcache_refuses_new_keys_and_missing_lengths():
    batch = PagedBatch([4], [1])
    q = torch.stack(batch.queries)
    with pytest.raises(NotImplementedError, match="k=a tensor"):
        kvcache_attention(q, batch.k_cache, batch.v_cache, k=torch.ones(1, 1, 2, D),
                          cache_seqlens=torch.tensor([4]), block_table=batch.block_table[:1])
    with pytest.raises(ValueError, match="cache_seqlens"):
        kvcache_attention(q, batch.k_cache, batch.v_cache, block_table=batch.block_table[:1])


def test_gqa_requires_head_multiple():
    with pytest.raises(ValueError, match="multiple"):
        attend_sequence(torch.ones(2, 3, D), torch.ones(2, 2, D), torch.ones(2, 2, D), 1.0)


def test_fa_version_answer():
    assert fa_version_answer("2.7.3") and fa_version_answer("2.1.0")
    assert not fa_version_answer("3.0.0")
    assert not fa_version_answer("2.7.4.post1", check_equality=False)


class _CausalCoreAttention:
    """What :func:`full_sequence_attention` reads of megatron-core's ``DotProductAttention``."""

    attn_mask_type = type("AttnMaskType", (), {"name": "causal"})()
    config = type("Config", (), {"softmax_scale": None})()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_attention_equals_paged_prefill_and_decode_bitwise(dtype):
    """The matched training attention over a right-padded batch ``[s, b, h, d]`` gives each token
    the bits of the engine's kernels: a paged full prefill, a prefix-cached tail and a decode step."""
    gen = torch.Generator().manual_seed(5)
    lengths, seqlen = [13, 9], 13
    q = torch.randn(seqlen, 2, 4, D, generator=gen).to(dtype)
    k = torch.randn(seqlen, 2, 2, D, generator=gen).to(dtype)
    v = torch.randn(seqlen, 2, 2, D, generator=gen).to(dtype)
    out = full_sequence_attention(_CausalCoreAttention(), q, k, v, None)
    assert out.shape == (seqlen, 2, 4 * D) and out.dtype == dtype
    for i, length in enumerate(lengths):
        batch = PagedBatch([length], [length], dtype=dtype)
        batch.queries = [q[:length, i]]
        for j in range(-(-length // BLOCK)):  # the sequence's keys into its paged blocks
            block, n = int(batch.block_table[0, j]), min(BLOCK, length - j * BLOCK)
            batch.k_cache[block, :n] = k[j * BLOCK:j * BLOCK + n, i]
            batch.v_cache[block, :n] = v[j * BLOCK:j * BLOCK + n, i]
        prefill = _run_varlen(batch)[:length]
        assert torch.equal(out[:length, i], prefill.reshape(length, -1)), f"sequence {i}: prefill"
        for start in (1, length - 1):  # a prefix-cached tail (varlen) and a decode step (kvcache)
            cu_q = torch.tensor([0, length - start], dtype=torch.int32)
            cu_k = torch.tensor([0, length], dtype=torch.int32)
            tail = varlen_attention(q[start:length, i], batch.k_cache, batch.v_cache, cu_q, cu_k, length - start,
                                    length, causal=True, block_table=batch.block_table[:1])
            assert torch.equal(out[start:length, i], tail.reshape(length - start, -1)), f"sequence {i}: tail {start}"
        decode = kvcache_attention(q[length - 1:length, i].unsqueeze(0), batch.k_cache, batch.v_cache,
                                   cache_seqlens=torch.tensor([length], dtype=torch.int32),
                                   block_table=batch.block_table[:1], causal=True)
        assert torch.equal(out[length - 1, i], decode.reshape(-1)), f"sequence {i}: decode"


def test_training_attention_refuses_what_the_engine_kernels_do_not_do():
    q = torch.zeros(3, 1, 2, D)
    with pytest.raises(NotImplementedError, match="only causal self-attention"):
        full_sequence_attention(_CausalCoreAttention(), q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="only causal self-attention"):
        full_sequence_attention(_CausalCoreAttention(), q, q[:2], q[:2], None)
