"""The CPU backend's multi-latent attention stand-ins (``megatron_ext.cpu_backend.mla``) against
float64 attention written out, and their installation into megatron-core's modules."""

from __future__ import annotations

import math
import types

import pytest
import torch

from megatron_ext import mcore
from megatron_ext.cpu_backend import attention, mla


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal (bottom-right) softmax attention in float64: q ``[Lq, H, D]``, k ``[Lk, Hk, D]``,
    v ``[Lk, Hk, Dv]`` (``Hk`` 1 or ``H``) -> ``[Lq, H, Dv]``."""
    q, k, v = q.double(), k.double(), v.double()
    lq, lk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k.expand(lk, q.shape[1], -1)) * scale
    visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v.expand(lk, q.shape[1], -1))


def test_flash_mla_attention_reads_the_latent_cache_through_the_block_table():
    torch.manual_seed(0)
    block, latent, head_dim_v, heads = 4, 10, 6, 3
    cache = torch.randn(7, block, 1, latent)
    # sequence 0: 6 cached tokens in blocks 5, 2; sequence 1: 3 tokens in block 0; a padding row
    table = torch.tensor([[5, 2, -1], [0, -1, -1]], dtype=torch.int32)
    lengths = torch.tensor([6, 3], dtype=torch.int32)
    q = torch.randn(3, 2, heads, latent)  # 2 query tokens per sequence (speculative shape)
    meta, splits = mla.mla_metadata(lengths, 2 * heads, 1)
    out, lse = mla.flash_mla_attention(q, cache, table, lengths, head_dim_v, meta, splits, softmax_scale=0.3,
                                       causal=True)
    assert out.shape == (3, 2, heads, head_dim_v) and lse.shape == (3, heads, 2)
    seq0 = torch.cat([cache[5], cache[2]])[:6]
    seq1 = cache[0][:3]
    torch.testing.assert_close(out[0].double(), naive(q[0], seq0, seq0[..., :head_dim_v], 0.3), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1].double(), naive(q[1], seq1, seq1[..., :head_dim_v], 0.3), rtol=1e-5, atol=1e-6)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and bool(torch.isinf(lse[2]).all())


def test_flash_mla_attention_refuses_what_it_does_not_implement():
    cache, table, lengths = torch.zeros(2, 4, 1, 8), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2])
    with pytest.raises(NotImplementedError, match="indices"):
        mla.flash_mla_attention(torch.zeros(1, 1, 2, 8), cache, table, lengths, 4, indices=torch.zeros(1))
    with pytest.raises(ValueError, match="2 KV heads"):
        mla.flash_mla_attention(torch.zeros(1, 1, 2, 8), torch.zeros(2, 4, 2, 8), table, lengths, 4)


def test_reference_core_attention_is_causal_attention_with_the_layer_scale():
    torch.manual_seed(1)
    causal = mcore.import_module("megatron.core.transformer.enums").AttnMaskType.causal
    core = mla.ReferenceMLACoreAttention(None, 1, causal, "self", softmax_scale=0.25, k_channels=24, v_channels=16)
    q, k, v = torch.randn(5, 2, 4, 24), torch.randn(5, 2, 4, 24), torch.randn(5, 2, 4, 16)
    out = core(q, k, v, attention_mask=None)
    assert out.shape == (5, 2, 4 * 16)
    for b in range(2):
        torch.testing.assert_close(out[:, b].double(), naive(q[:, b], k[:, b], v[:, b], 0.25).reshape(5, -1),
                                   rtol=1e-5, atol=1e-6)
    assert mla.ReferenceMLACoreAttention(None, 1, causal, "self", k_channels=16).softmax_scale == 0.25
    with pytest.raises(NotImplementedError, match="causal self-attention"):
        core(q, k[:3], v[:3], attention_mask=None)


def test_split_norm_linear_copies_the_layers_own_kv_norm_and_linear_as_te_does():
    identity = mcore.import_module("megatron.core.transformer.identity_op").IdentityOp
    linear, rms = torch.nn.Linear(4, 4), torch.nn.RMSNorm(4)
    norm, twin = mla.split_norm_linear(linear, types.SimpleNamespace(qk_layernorm=False))
    assert isinstance(norm, identity) and type(twin) is torch.nn.Linear  # no KV norm
    assert twin.weight is not linear.weight and torch.equal(twin.weight, linear.weight)
    assert twin.bias is not linear.bias and torch.equal(twin.bias, linear.bias)
    with pytest.raises(NotImplementedError, match="the KV norm of this linear_kv_up_proj is unknown"):
        mla.split_norm_linear(linear, types.SimpleNamespace(qk_layernorm=True))
    mla.register_kv_norm(linear, rms)
    norm, twin = mla.split_norm_linear(linear, types.SimpleNamespace(qk_layernorm=True))
    assert type(norm) is torch.nn.RMSNorm and norm.weight is not rms.weight and torch.equal(norm.weight, rms.weight)
    with torch.no_grad():
        twin.weight.add_(1.0)  # the copies are the split's own
    assert not torch.equal(twin.weight, linear.weight)


def test_mla_on_cpu_installs_and_restores():
    attention_module = mcore.import_module(attention.ATTENTION_MODULE)
    mla_module = mcore.import_module(mla.MLA_MODULE)
    before = (attention_module.flash_mla_with_kvcache, attention_module.get_mla_metadata,
              mla_module.split_te_layernorm_column_parallel_linear)
    with mla.mla_on_cpu():
        assert attention_module.flash_mla_with_kvcache is mla.flash_mla_attention
        assert attention_module.get_mla_metadata is mla.mla_metadata
        assert mla_module.split_te_layernorm_column_parallel_linear is mla.split_norm_linear
    after = (attention_module.flash_mla_with_kvcache, attention_module.get_mla_metadata,
             mla_module.split_te_layernorm_column_parallel_linear)
    assert all(a is b for a, b in zip(before, after))
