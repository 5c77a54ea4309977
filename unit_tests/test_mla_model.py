"""The harness's multi-latent attention model (``megatron_ext.harness.mla``): what it builds from
``mla_tiny``."""

from __future__ import annotations

import math

import torch

from megatron_ext import mcore
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.cpu_backend.mla import ReferenceMLACoreAttention, split_norm_linear
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.engine import build_model, ensure_model_parallel
from megatron_ext.harness.mla import mla_self_attention_class


def test_mla_tiny_builds_megatron_cores_mla_layers_with_cached_latents():
    with cpu_backend():
        ensure_model_parallel()
        model = build_model(load_case("mla_tiny"))
    config = model.config
    transformer = mcore.import_module("megatron.core.transformer.transformer_config")
    assert isinstance(config, transformer.MLATransformerConfig)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim,
            config.cache_mla_latents, config.rope_type) == (32, 32, 16, 8, 16, True, "rope")
    attention = model.decoder.layers[0].self_attention
    base = mcore.import_module("megatron.core.transformer.multi_latent_attention").MLASelfAttention
    assert type(attention) is mla_self_attention_class() and isinstance(attention, base)
    assert isinstance(attention.core_attention, ReferenceMLACoreAttention)
    assert attention.core_attention.softmax_scale == attention.softmax_scale == 1 / math.sqrt(16 + 8)
    assert tuple(attention.linear_kv_up_proj.weight.shape) == (4 * (16 + 16), 32)
    # qk_layernorm: the local spec's own KV norm, which the latent path's split keeps
    norm = attention.kv_layernorm
    assert type(norm).__name__ != "IdentityOp" and tuple(norm.weight.shape) == (32,)
    # the latent path's split copies the KV norm and linear, as TE's does (fault M1 then shows on the CPU)
    split_norm, split_linear = split_norm_linear(attention.linear_kv_up_proj, config)
    assert type(split_norm) is type(norm) and type(split_linear) is type(attention.linear_kv_up_proj)
    assert split_norm.weight is not norm.weight and torch.equal(split_norm.weight, norm.weight)
    assert split_linear.weight is not attention.linear_kv_up_proj.weight
    assert torch.equal(split_linear.weight, attention.linear_kv_up_proj.weight)
    assert next(model.parameters()).dtype is torch.bfloat16


def test_moe_mla_mtp_tiny_drafts_without_latents_and_records_decoder_routers_only():
    """``moe_mla_mtp_tiny``: the MTP layer's MLA keeps no latent cache (megatron-core's draft forward
    passes no inference context) while the decoder's do, and routing replay records the 2 decoder
    MoE routers, not the MTP layer's (whose draft forwards see other tokens)."""
    from megatron_ext.harness.mla import mla_draft_attention_class
    from megatron_ext.harness.routing import router_replays

    with cpu_backend():
        ensure_model_parallel()
        model = build_model(load_case("moe_mla_mtp_tiny"))
        base = mcore.import_module("megatron.core.transformer.multi_latent_attention").MLASelfAttention
        decoder = [m for m in model.decoder.modules() if isinstance(m, base)]
        draft = [m for m in model.mtp.modules() if isinstance(m, base)]
        assert [type(m) for m in decoder] == [mla_self_attention_class()] * 2
        assert [type(m) for m in draft] == [mla_draft_attention_class()]
        assert [m.cache_mla_latents for m in decoder + draft] == [True, True, False]
        assert (model.config.cache_mla_latents, draft[0].config.cache_mla_latents) == (True, False)
        replays = router_replays(model)
        in_mtp = [m.router_replay for m in model.mtp.modules() if getattr(m, "router_replay", None) is not None]
        assert len(replays) == 2 and len(in_mtp) == 1 and in_mtp[0] not in replays
        module = mcore.import_module("megatron.core.transformer.moe.router_replay")
        assert module.RouterReplay.global_router_replay_instances == replays
        # the engine's draft step: 3 requests' last hidden states, no inference context
        with torch.inference_mode():
            hidden, logits = model.compute_mtp_single_step(
                hidden_states=torch.randn(3, 1, 64), next_token_ids=torch.tensor([[65, 66, 67]]),
                position_ids=torch.tensor([[150, 151, 152]]), depth=0)  # 0.17 requires depth
    assert tuple(hidden.shape) == (3, 1, 64) and logits.shape[:2] == (3, 1)
    assert hasattr(draft[0], "linear_kv_up_proj")  # no absorption: the plain path keeps it
