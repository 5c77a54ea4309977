"""Fault M1: after ``prepare_for_absorption`` a weight update must reach every copy of MLA's KV up-projection.

``mla_tiny``'s model (fp32) is absorbed the way its first inference forward absorbs it, with the
CPU backend's split, which copies the weights as Transformer Engine's does. Each test then updates
the weights one way a trainer does and requires the decode-only path's ``up_k_weight`` /
``up_v_weight``, the prefill path's ``linear_kv_up_proj_linear`` and ``kv_layernorm`` to hold
exactly the new values. With ``MEGATRON_EXT_TEST_UNPATCHED=1`` all three fail on every release
(same ``prepare_for_absorption`` in 0.17.1, 0.18.2 and 0.19.2). End to end (an engine across a
weight update): functional_tests/test_mla.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness.cases import Case, load_case
from megatron_ext.harness.engine import build_model, ensure_model_parallel
from megatron_ext.cpu_backend.mla import split_norm_linear
from megatron_ext.patches.mla_absorbed_weights import share_split_weights

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

#: ``mla_tiny``: 4 heads, qk_head_dim 16, v_head_dim 16, kv_lora_rank 32.
HEADS, QK, V, RANK = 4, 16, 16, 32


def mla_case(seed: int = 1234) -> Case:
    data = load_case("mla_tiny").model_dump()
    data["model"].update(params_dtype="fp32", seed=seed)
    return Case.model_validate(data)


def build(seed: int = 1234):
    with cpu_backend():
        ensure_model_parallel()
        return build_model(mla_case(seed))


def absorb(model) -> None:
    with cpu_backend(), torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attention.prepare_for_absorption()


def bump(params, offset: float = 0.25) -> None:
    """Add ``offset`` to every element of each KV up-projection and KV norm parameter, in place."""
    with torch.no_grad():
        for name, param in params.items():
            if "kv_up_proj" in name or "kv_layernorm" in name:
                param.data.add_(offset)


def assert_every_copy_equals(attention, weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """``weight`` ``[HEADS * (QK + V), RANK]`` fp32 in each path of an absorbed layer."""
    heads = weight.view(HEADS, QK + V, RANK)
    assert torch.equal(attention.up_k_weight, heads[:, :QK])  # decode-only steps
    assert torch.equal(attention.up_v_weight, heads[:, QK:])
    assert torch.equal(attention.linear_kv_up_proj_linear.weight, weight)  # prefill and mixed steps
    assert torch.equal(attention.kv_layernorm.weight, norm_weight)


def test_an_update_through_handles_taken_before_absorption_reaches_prefill_steps(runtime_patches):
    model = build()
    before = dict(model.named_parameters())  # an optimizer or a refit's cached tensor dict
    absorb(model)
    bump(before)
    for i, layer in enumerate(model.decoder.layers):
        prefix = f"decoder.layers.{i}.self_attention."
        assert_every_copy_equals(layer.self_attention, before[prefix + "linear_kv_up_proj.weight"],
                                 before[prefix + "kv_layernorm.weight"])


def test_an_update_through_named_parameters_after_absorption_reaches_decode_steps(runtime_patches):
    model = build()
    expected = build()
    bump(dict(expected.named_parameters()))
    absorb(model)
    after = dict(model.named_parameters())
    assert "decoder.layers.0.self_attention.linear_kv_up_proj_linear.weight" in after
    bump(after)
    for layer, fresh in zip(model.decoder.layers, expected.decoder.layers):
        assert_every_copy_equals(layer.self_attention, fresh.self_attention.linear_kv_up_proj.weight,
                                 fresh.self_attention.kv_layernorm.weight)


def test_a_state_dict_under_megatron_cores_names_loads_strictly_after_absorption(runtime_patches):
    model, other = build(), build(seed=99)
    absorb(model)
    model.load_state_dict(other.state_dict(), strict=True)
    for layer, fresh in zip(model.decoder.layers, other.decoder.layers):
        assert_every_copy_equals(layer.self_attention, fresh.self_attention.linear_kv_up_proj.weight,
                                 fresh.self_attention.kv_layernorm.weight)


def test_a_split_parameter_that_is_not_an_exact_copy_is_left_alone():
    model = build()
    attention = model.decoder.layers[0].self_attention
    fused, norm = attention.linear_kv_up_proj, attention.kv_layernorm
    # the state the released split leaves (copies), built with the CPU backend's TE-like split
    attention.kv_layernorm, attention.linear_kv_up_proj_linear = split_norm_linear(fused, model.config)
    with torch.no_grad():
        attention.linear_kv_up_proj_linear.weight.add_(1.0)  # no longer a copy of the fused weight
    assert share_split_weights(attention, fused, norm) == 1  # the norm only
    assert attention.kv_layernorm.weight is norm.weight
    assert attention.linear_kv_up_proj_linear.weight is not fused.weight
    assert share_split_weights(attention, fused, norm) == 0  # shared already


def test_a_second_call_keeps_the_first_split_and_its_shared_weights(runtime_patches):
    model = build()
    attention = model.decoder.layers[0].self_attention
    fused_weight = attention.linear_kv_up_proj.weight
    absorb(model)
    linear = attention.linear_kv_up_proj_linear
    absorb(model)  # every later forward calls it again: the released hasattr guard returns
    assert attention.linear_kv_up_proj_linear is linear and not hasattr(attention, "linear_kv_up_proj")
    assert torch.equal(linear.weight, fused_weight)
