"""Fault 2 on the multi-latent attention (MLA) latent path, on a real ``DynamicInferenceContext``.

With ``cache_mla_latents`` the context's KV cache is ``[layers, blocks, 64, kv_lora_rank +
qk_pos_emb_head_dim]`` and ``append_key_value_cache`` takes its latent branch (one vector per
token, passed as ``key``; no value). The KV-write audit wraps that same method, so it sees latent
writes; these tests feed it one. Prompt A is two full 64-token blocks; request 2 asks A exactly,
matches both blocks and recomputes tokens inside the second (0.17: its last token; 0.18+: the
>= 2-token clamp rounds the skip down to a block boundary, so the whole second block).
"""

from __future__ import annotations

import pytest
import torch

import megatron_ext
from megatron_ext import mcore
from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.audits import FAULT_OF_KIND, ContextAudit
from megatron_ext.harness.engine import ensure_model_parallel
from megatron_ext.harness.factories import prefix_caching_request

from .allocator_factory import block_count

BLOCK = 64  # megatron-core's latent cache asserts it
LATENT = 32 + 8  # kv_lora_rank + qk_pos_emb_head_dim
A = list(range(1000, 1000 + 2 * BLOCK))
SERIES = mcore.release_series(mcore.installed_version())
#: tokens request 2 recomputes inside its second matched block (see the module docstring)
RECOMPUTED = 1 if SERIES == "0.17" else BLOCK


def latent_context():
    """A prefix-caching context of a 2-layer MLA model with cached latents (fp32, block size 64)."""
    config = mcore.import_module("megatron.core.inference.config")
    transformer = mcore.import_module("megatron.core.transformer.transformer_config")
    dynamic_context = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    ensure_model_parallel()
    model_config = transformer.MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
        qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope", cache_mla_latents=True,
        params_dtype=torch.float32)
    inference = config.InferenceConfig(
        block_size_tokens=BLOCK, buffer_size_gb=0.001, max_requests=4, max_tokens=512, max_sequence_length=256,
        enable_prefix_caching=True,
        prefix_caching_eviction_policy=config.PrefixCachingEvictionPolicy.REF_ZERO)
    return dynamic_context.DynamicInferenceContext(model_config, inference)


@pytest.fixture(params=[False, True], ids=["unpatched", "patched"])
def patched(request):
    megatron_ext.revert()
    if request.param:
        megatron_ext.apply()
    yield request.param
    megatron_ext.revert()


def append_latents(ctx) -> torch.Tensor:
    """What one MLA layer does in a step: append one latent vector per active token (``[T, 1, D]``,
    padding rows included) to layer 1's latent cache; returns the vectors."""
    ctx.initialize_attention_state()
    if SERIES == "0.18":  # 0.19 transfers inside initialize_attention_state, 0.17 has no GPU view
        ctx.transfer_bookkeeping_to_gpu()
    latents = torch.arange(ctx.padded_active_token_count * LATENT, dtype=torch.float32).view(-1, 1, LATENT)
    ctx.append_key_value_cache(1, latents, None)
    return latents


def test_a_latent_write_into_a_matched_block_is_fault_2_unless_patched(patched):
    with cuda_on_cpu():
        ctx = latent_context()
        assert ctx.cache_mla_latent and tuple(ctx.memory_buffer.shape[1:]) == (block_count(ctx.kv_block_allocator), BLOCK, LATENT)
        audit = ContextAudit(ctx).attach()
        ctx.add_request(prefix_caching_request(1, A, BLOCK))
        shared = ctx.request_to_kv_block_ids[0][:2].tolist()
        ctx.add_request(prefix_caching_request(2, A, BLOCK))
        assert ctx.request_to_kv_block_ids[1][:2].tolist() == shared  # both blocks matched
        assert audit.kv_writes.matched_blocks[2] == set(shared)
        latents = append_latents(ctx)  # rows 0..127: request 1's tokens, then request 2's
        audit.detach()
        kinds = [(v.kind, v.step, v.block, v.request_id) for v in audit.violations]
        if patched:  # matched-block-writes sends request 2's latent writes to the dummy block
            assert kinds == []
            assert audit.kv_writes.kv_writes_redirected == RECOMPUTED
            assert torch.equal(ctx.memory_buffer[0, shared[1]], latents[BLOCK:2 * BLOCK, 0])  # request 1's own
        else:
            assert kinds == [("kv_write", 0, shared[1], 2)]
            assert audit.violations[0].detail == f"request 2 wrote KV into block {shared[1]}, obtained by hash match"
            assert audit.kv_writes.kv_writes_redirected == 0
            # request 2's recomputed latents (rows 128..) were sent into the shared block, beside
            # request 1's own (rows 64..127) in the same index_put_: which of two writes to one slot
            # survives is undefined, so each slot holds one of the two vectors
            recomputed = range(2 * BLOCK, 2 * BLOCK + RECOMPUTED)
            assert ctx.token_to_block_idx[recomputed].tolist() == [shared[1]] * RECOMPUTED
            assert ctx.token_to_local_position_within_kv_block[recomputed].tolist() == list(range(BLOCK - RECOMPUTED, BLOCK))
            slots = ctx.memory_buffer[0, shared[1], BLOCK - RECOMPUTED:]
            own, recomputed_rows = latents[2 * BLOCK - RECOMPUTED:2 * BLOCK, 0], latents[recomputed, 0]
            assert ((slots == own).all(dim=1) | (slots == recomputed_rows).all(dim=1)).all()
            assert FAULT_OF_KIND["kv_write"] == "fault 2 (matched-block-writes)"
        assert audit.kv_writes.kv_writes_checked == 2 * BLOCK + RECOMPUTED
