"""Megatron-LM args <-> ModelSpec (``megatron_ext.harness.checkpoint_args``) and the restricted
reader of a checkpoint's common state (``checkpoint.read_common_state``).

* Round trip: ``megatron_lm_args`` of a ModelSpec read back by ``model_spec_from_args`` gives the
  same ModelSpec (today's default GPT and a Llama-style one), with Megatron-LM's names and values.
* Refusals: every argument kind the harness cannot build is refused by name and value
  (CheckpointError, one line); missing required args are named.
* Megatron-LM conventions: ``group_query_attention`` gates ``num_query_groups``; old
  ``disable_bias_linear`` / ``use_rotary_position_embeddings``; ``kv_channels`` equal to
  hidden / heads is the default; fusion flags are ignored.
* Hybrid models: the layer pattern (``hybrid_layer_pattern`` or the older
  ``hybrid_override_pattern``), the Mamba sizes (Megatron-LM's defaults where absent), the
  inference state dtypes, megatron-core's hybrid stack spec accepted; patterns derived from ratios,
  with multi-token prediction layers after "/", or given twice differently are refused by name.
* ``read_common_state`` of a ``common.pt`` holding objects of classes outside megatron-core's
  safe globals: plain values read, the unknown objects come back as ``UnloadedObject`` and
  nothing named in the file runs.
"""

from __future__ import annotations

import argparse
import pickle
import enum
from pathlib import Path

import pytest
import torch

from megatron_ext.harness.cases import ModelSpec
from megatron_ext.harness.checkpoint import CheckpointError, CheckpointSource, UnloadedObject, read_common_state
from megatron_ext.harness.checkpoint_args import (check_case_model_matches_args, megatron_lm_args, model_spec_from_args,
                                                 shapeless_disagreements)

LLAMA = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                  ffn_hidden_size=176, normalization="RMSNorm", swiglu=True,
                  position_embedding_type="rope", rotary_base=500000, rotary_percent=0.5,
                  add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
                  vocab_size=512, params_dtype="bf16", init_method_std=0.1)


def test_default_model_unchanged():
    """The defaults are the model megatron-ext always built (GPTModel's untied default included)."""
    spec = ModelSpec()
    assert (spec.normalization, spec.norm_epsilon, spec.swiglu, spec.position_embedding_type,
            spec.rotary_base, spec.rotary_percent, spec.add_bias_linear, spec.add_qkv_bias,
            spec.untie_embeddings_and_output_weights, spec.qk_layernorm, spec.kv_channels) == \
        ("LayerNorm", 1e-5, False, "learned_absolute", 10000, 1.0, True, False, True, False, None)
    assert spec.effective_ffn_hidden_size() is None


def test_swiglu_default_ffn_is_megatron_lms():
    assert ModelSpec(swiglu=True, hidden_size=64).effective_ffn_hidden_size() == 128   # int(170.67/64)*64
    assert ModelSpec(swiglu=True, hidden_size=4096).effective_ffn_hidden_size() == 10880
    assert ModelSpec(swiglu=True, ffn_hidden_size=176).effective_ffn_hidden_size() == 176
    with pytest.raises(ValueError, match="ffn_hidden_size 0; set ffn_hidden_size"):
        ModelSpec(swiglu=True, hidden_size=16)
    with pytest.raises(ValueError, match="num_query_groups=3 must divide num_attention_heads=8"):
        ModelSpec(num_attention_heads=8, num_query_groups=3)


@pytest.mark.parametrize("spec", [ModelSpec(), LLAMA, ModelSpec(params_dtype="fp32", kv_channels=32,
                                                                 add_qkv_bias=True, add_bias_linear=False)],
                         ids=["default-gpt", "llama", "fp32-kv-channels-qkv-bias"])
def test_args_round_trip(spec):
    args = megatron_lm_args(spec, spec.vocab_size)
    assert isinstance(args, argparse.Namespace)
    assert model_spec_from_args(args, "ckpt", spec) == spec


def test_llama_args_have_megatron_lm_names_and_values():
    args = vars(megatron_lm_args(LLAMA, 512, 2, 1))
    expected = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8,
                    group_query_attention=True, num_query_groups=2, kv_channels=8,
                    normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, qk_layernorm=True,
                    position_embedding_type="rope", add_position_embedding=False,
                    use_rotary_position_embeddings=True, rotary_base=500000, rotary_percent=0.5,
                    add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
                    padded_vocab_size=512, max_position_embeddings=1024, seq_length=1024,
                    params_dtype=torch.bfloat16, bf16=True, fp16=False, init_method_std=0.1,
                    tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                    num_experts=None, multi_latent_attention=False, mtp_num_layers=None,
                    ckpt_format="torch_dist")
    assert {k: args[k] for k in expected} == expected
    default = vars(megatron_lm_args(ModelSpec(), 257))
    assert (default["ffn_hidden_size"], default["num_query_groups"], default["group_query_attention"],
            default["kv_channels"], default["init_method_std"]) == (256, 4, False, 16, 0.02)


def _args(**changes) -> argparse.Namespace:
    args = megatron_lm_args(LLAMA, 512)
    for name, value in changes.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize("changes, named", [
    ({"num_experts": 64, "moe_shared_expert_intermediate_size": 128},
     "moe_shared_expert_intermediate_size=128 (shared experts)"),
    ({"num_experts": 64, "moe_layer_freq": 2},
     "moe_layer_freq=2 (experts in some layers only; the harness puts them in every layer)"),
    ({"multi_latent_attention": True, "rope_type": "ntk"},
     "multi_latent_attention=True with rope_type='ntk' (megatron-core's MLA builds 'rope' or 'yarn')"),
    ({"spec": ["my.module", "layer_spec"]}, "spec=['my.module', 'layer_spec'] (a custom layer spec module)"),
    ({"apply_layernorm_1p": True}, "apply_layernorm_1p=True (zero-centered (1p) layer norm)"),
    ({"squared_relu": True}, "squared_relu=True (squared-ReLU activation)"),
    ({"rotary_interleaved": True}, "rotary_interleaved=True (interleaved rotary embeddings)"),
    ({"use_rope_scaling": True}, "use_rope_scaling=True (Llama-3.1 RoPE scaling)"),
    ({"fp16": True, "bf16": False}, "fp16=True (fp16 parameters (the harness builds fp32 or bf16))"),
    ({"window_size": (4096, 0)}, "window_size=(4096, 0) (sliding-window attention)"),
    ({"softmax_type": "learnable"}, "softmax_type='learnable' (a softmax other than the default (off-by-one or learnable))"),
    ({"num_experts": 8, "expert_model_parallel_size": 2},
     "expert_model_parallel_size=2 (expert parallelism (the harness keeps every expert on every rank))"),
    ({"mtp_hybrid_override_pattern": "*E"}, "mtp_hybrid_override_pattern='*E' (MTP layers of a hybrid model)"),
    ({"position_embedding_type": "mrope"}, "position_embedding_type='mrope' (the harness builds learned_absolute or rope or none)"),
    ({"normalization": "L2Norm"}, "normalization='L2Norm' (the harness builds LayerNorm or RMSNorm)"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_unsupported_argument_is_refused_by_name(changes, named):
    with pytest.raises(CheckpointError) as info:
        model_spec_from_args(_args(**changes), "--load /ckpt")
    message = str(info.value)
    assert message == f"--load /ckpt: the checkpoint's model has arguments the harness cannot build: {named}"
    assert "\n" not in message


def test_mtp_layers_round_trip_through_the_args():
    spec = LLAMA.model_copy(update={"mtp_num_layers": 1, "mtp_use_repeated_layer": True})
    args = megatron_lm_args(spec, 512)
    assert (args.mtp_num_layers, args.mtp_use_repeated_layer) == (1, True)
    assert model_spec_from_args(args, "ckpt", LLAMA) == spec
    assert model_spec_from_args(_args(mtp_num_layers=0), "ckpt", LLAMA).mtp_num_layers is None


def test_mla_args_round_trip_with_megatron_lm_names():
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                     position_embedding_type="rope", qk_layernorm=True, multi_latent_attention=True,
                     q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
    args = megatron_lm_args(spec, spec.vocab_size)
    assert {k: getattr(args, k) for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                          "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "cache_mla_latents")} == {
        "multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "rope_type": "yarn", "cache_mla_latents": True}
    assert model_spec_from_args(args, "ckpt", spec) == spec
    rope = spec.model_copy(update={"rope_type": "rope"})
    assert megatron_lm_args(rope, rope.vocab_size).rope_type == "rope"
    assert model_spec_from_args(megatron_lm_args(rope, rope.vocab_size), "ckpt", rope) == rope
    for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        delattr(args, name)  # Megatron-LM's defaults: no query compression, 32, 128, 64, 128
    args.qk_layernorm = False
    built = model_spec_from_args(args, "ckpt", spec)
    assert (built.q_lora_rank, built.kv_lora_rank, built.qk_head_dim, built.qk_pos_emb_head_dim, built.v_head_dim) == (
        None, 32, 128, 64, 128)
    assert vars(megatron_lm_args(LLAMA, 512))["multi_latent_attention"] is False


def test_mla_yarn_parameters_round_trip_and_take_megatron_lm_defaults_where_absent():
    """YaRN's parameters under Megatron-LM's argument names (``--rotary-scaling-factor``, ``--mscale``,
    ``--mscale-all-dim``) and ``MLATransformerConfig``'s for the rest; absent: Megatron-LM's argument
    defaults (1.0, 1.0, 0.0) and megatron-core's (4096, 32, 1); ``rope_type`` None: yarn."""
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                     position_embedding_type="rope", multi_latent_attention=True, rotary_scaling_factor=8.0,
                     original_max_position_embeddings=256, beta_fast=16.0, beta_slow=2.0, mscale=0.707,
                     mscale_all_dim=0.5)
    args = megatron_lm_args(spec, spec.vocab_size)
    assert {k: getattr(args, k) for k in ("rope_type", "rotary_scaling_factor", "original_max_position_embeddings",
                                          "beta_fast", "beta_slow", "mscale", "mscale_all_dim")} == {
        "rope_type": "yarn", "rotary_scaling_factor": 8.0, "original_max_position_embeddings": 256,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 0.5}
    assert model_spec_from_args(args, "ckpt", spec) == spec
    assert shapeless_disagreements(spec, args) == []
    for name in ("rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim"):
        delattr(args, name)
    args.rope_type = None  # Megatron-LM's --rope-type default
    built = model_spec_from_args(args, "ckpt", spec)
    assert (built.rope_type, built.rotary_scaling_factor, built.original_max_position_embeddings, built.beta_fast,
            built.beta_slow, built.mscale, built.mscale_all_dim) == ("yarn", 1.0, 4096, 32, 1, 1.0, 0.0)
    # a case's model section that disagrees on them is a silently different model: compared
    assert shapeless_disagreements(spec, args) == [
        ("rotary_scaling_factor", 8.0, 1.0), ("original_max_position_embeddings", 256, 4096), ("beta_fast", 16.0, 32.0),
        ("beta_slow", 2.0, 1.0), ("mscale", 0.707, 1.0), ("mscale_all_dim", 0.5, 0.0)]
    args.rope_type = "rope"
    assert shapeless_disagreements(spec, args)[0] == ("rope_type", "yarn", "rope")


def test_several_refusals_are_all_named():
    with pytest.raises(CheckpointError, match=r"cannot build: moe_grouped_gemm=True \(grouped-GEMM experts "
                                              r"\(the harness builds SequentialMLP experts\)\); "
                                              r"window_size=\(4096, 0\) \(sliding-window attention\)$"):
        model_spec_from_args(_args(num_experts=8, moe_grouped_gemm=True, window_size=(4096, 0)), "--load /ckpt")


def test_mixture_of_experts_args_build_the_moe_model():
    spec = model_spec_from_args(_args(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
                                      moe_enable_routing_replay=True), "--load /ckpt", LLAMA)
    assert (spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size, spec.moe_enable_routing_replay) == \
        (8, 2, 96, True)
    args = vars(megatron_lm_args(spec, 512))
    assert {k: args[k] for k in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                 "moe_enable_routing_replay", "moe_layer_freq")} == {
        "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 96, "moe_enable_routing_replay": True,
        "moe_layer_freq": 1}
    assert model_spec_from_args(argparse.Namespace(**args), "ckpt", LLAMA) == spec


def test_absent_or_zero_unsupported_arguments_are_accepted():
    args = _args(num_experts=0, mtp_num_layers=0)
    for name in ("multi_latent_attention", "spec", "rotary_interleaved", "use_rope_scaling"):
        delattr(args, name)
    assert model_spec_from_args(args, "ckpt", LLAMA) == LLAMA


def test_missing_required_arguments_are_named():
    args = _args()
    del args.padded_vocab_size, args.max_position_embeddings, args.seq_length
    with pytest.raises(CheckpointError, match=r"^ckpt: the checkpoint's args lack padded_vocab_size, "
                                              r"max_position_embeddings \(or seq_length\); pass a --case"):
        model_spec_from_args(args, "ckpt")


def test_values_modelspec_refuses_are_named():
    with pytest.raises(CheckpointError, match=r"args do not make a model the harness can build: "
                                              r"field 'vocab_size': Input should be greater than or equal to 257"):
        model_spec_from_args(_args(padded_vocab_size=128), "ckpt")


def test_megatron_lm_conventions():
    # num_query_groups counts only with group_query_attention (Megatron-LM stores both always)
    assert model_spec_from_args(_args(group_query_attention=False), "c").num_query_groups is None
    # kv_channels equal to hidden / heads is the default; fusion and runtime flags are not read
    spec = model_spec_from_args(_args(kv_channels=8, apply_rope_fusion=True, bias_swiglu_fusion=True,
                                      masked_softmax_fusion=True, sequence_parallel=True), "c", LLAMA)
    assert spec == LLAMA
    # a Megatron-LM from before add_bias_linear / position_embedding_type
    old = _args()
    del old.add_bias_linear, old.position_embedding_type
    old.disable_bias_linear, old.use_rotary_position_embeddings = True, True
    assert model_spec_from_args(old, "c", LLAMA) == LLAMA
    # Megatron-LM's own default: tied embeddings when the argument is absent
    del old.untie_embeddings_and_output_weights
    assert model_spec_from_args(old, "c", LLAMA).untie_embeddings_and_output_weights is False


class _Scope(enum.Enum):
    """Stands for an enum of a megatron-core release the reader does not have."""

    FULL = "full"


_RAN = []


def _must_not_run(path):
    _RAN.append(path)
    Path(path).write_text("ran")
    return "ran"


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return _must_not_run, (self.path,)


def test_common_state_with_unknown_classes_reads_without_running_anything(tmp_path):
    marker = tmp_path / "marker"
    args = megatron_lm_args(LLAMA, 512)
    args.inference_cuda_graph_scope = _Scope.FULL
    args.hook = _Payload(str(marker))
    torch.save({"args": args, "iteration": 3, "checkpoint_version": 3.0}, tmp_path / "common.pt")
    state = read_common_state(tmp_path)
    assert not marker.exists() and _RAN == []
    assert (state["iteration"], state["checkpoint_version"]) == (3, 3.0)
    read = state["args"]
    assert isinstance(read, argparse.Namespace)
    assert isinstance(read.inference_cuda_graph_scope, UnloadedObject)
    assert read.inference_cuda_graph_scope.name == f"{__name__}._Scope"
    assert read.inference_cuda_graph_scope.args == ("full",)
    assert isinstance(read.hook, UnloadedObject) and read.hook.name == f"{__name__}._must_not_run"
    assert read.params_dtype is torch.bfloat16
    assert model_spec_from_args(read, "c", LLAMA) == LLAMA


def test_legacy_format_common_state_is_refused_without_running_anything(tmp_path):
    # torch's legacy (non-zip) format reads its first object with pickle_module.load: a payload
    # there once ran before any error
    marker = tmp_path / "marker"
    (tmp_path / "common.pt").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match=r"common.pt: the save did not finish or the file is damaged "
                                              r"\(not a torch zip archive\)"):
        read_common_state(tmp_path)
    assert not marker.exists() and _RAN == []


@pytest.mark.parametrize("content", [b"", b"hello world", b"PK\x03\x04truncated"])
def test_damaged_common_state_is_one_checkpoint_error(tmp_path, content):
    (tmp_path / "common.pt").write_bytes(content)
    with pytest.raises(CheckpointError, match="the save did not finish or the file is damaged"):
        read_common_state(tmp_path)


def test_common_state_missing_is_refused(tmp_path):
    (tmp_path / "common.pt").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"cannot read the common state of .*common.pt"):
        read_common_state(tmp_path)
    (tmp_path / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"cannot read the index \(.metadata\) of"):
        read_common_state(tmp_path)


# ------------------------------------------- a model section that disagrees where shapes cannot show it


@pytest.mark.parametrize("field, theirs", [("norm_epsilon", 1e-6), ("rotary_base", 10000), ("rotary_percent", 1.0)])
def test_values_shapes_cannot_show_are_compared(field, theirs):
    args = megatron_lm_args(LLAMA, 512)
    setattr(args, field, theirs)
    assert shapeless_disagreements(LLAMA, args) == [(field, getattr(LLAMA, field), theirs)]
    assert shapeless_disagreements(LLAMA, megatron_lm_args(LLAMA, 512)) == []


def test_megatron_lm_defaults_stand_in_for_missing_args():
    args = megatron_lm_args(ModelSpec(), 257)
    for name in ("norm_epsilon", "rotary_base", "rotary_percent"):
        delattr(args, name)
    assert shapeless_disagreements(ModelSpec(), args) == []
    assert shapeless_disagreements(ModelSpec(norm_epsilon=1e-6), args) == [("norm_epsilon", 1e-6, 1e-5)]


def test_rotary_values_of_a_learned_position_model_are_not_compared():
    # learned absolute positions: rotary_base / rotary_percent are unused (and a rope checkpoint
    # would show as a missing position-embedding tensor)
    spec = ModelSpec()
    args = megatron_lm_args(spec, 257)
    args.rotary_base, args.rotary_percent = 500000, 0.5
    assert shapeless_disagreements(spec, args) == []


def test_attention_geometry_is_compared_only_where_the_shapes_agree():
    ours = ModelSpec(num_attention_heads=8)  # hidden 64: 8 heads of 8 channels
    same_shapes = megatron_lm_args(ModelSpec(num_attention_heads=4), 257)  # 4 heads of 16: same qkv shape
    assert shapeless_disagreements(ours, same_shapes) == [("num_attention_heads", 8, 4), ("num_query_groups", 8, 4),
                                                          ("kv_channels", 8, 16)]
    other_shapes = megatron_lm_args(ModelSpec(num_attention_heads=4, kv_channels=8), 257)  # qkv rows differ
    assert shapeless_disagreements(ours, other_shapes) == []


def _source_with_args(tmp_path, args) -> CheckpointSource:
    torch.save({"args": args, "iteration": 3, "checkpoint_version": 3.0}, tmp_path / "common.pt")
    return CheckpointSource(requested=str(tmp_path), path=str(tmp_path), iteration=3)


def test_disagreeing_model_section_is_refused_naming_both_values_and_the_fix(tmp_path):
    args = megatron_lm_args(LLAMA, 512)
    args.norm_epsilon, args.rotary_base = 1e-6, 10000
    with pytest.raises(CheckpointError) as error:
        check_case_model_matches_args(_source_with_args(tmp_path, args), LLAMA)
    assert str(error.value) == (
        f"--load {tmp_path}: the case's model section has norm_epsilon=1e-05 but the checkpoint's Megatron-LM "
        "args have norm_epsilon=1e-06, rotary_base: 500000 vs 10000 (the weights' shapes cannot show it, so the "
        "run would use the wrong one); set norm_epsilon: 1e-06 in the case's model section, or leave the model "
        "section out to build the model from the checkpoint's args")
    assert "\n" not in str(error.value)


def test_agreeing_model_section_or_no_args_passes(tmp_path):
    check_case_model_matches_args(_source_with_args(tmp_path, megatron_lm_args(LLAMA, 512)), LLAMA)
    torch.save({"iteration": 3}, tmp_path / "common.pt")  # saved by dist_checkpointing.save alone: no args
    check_case_model_matches_args(CheckpointSource(str(tmp_path), str(tmp_path), 3), LLAMA)


HYBRID = ModelSpec(hybrid_layer_pattern="M*M-", hidden_size=32, num_attention_heads=2, mamba_state_dim=8,
                   mamba_head_dim=16, mamba_num_groups=1, position_embedding_type="none", normalization="RMSNorm",
                   params_dtype="fp32", add_bias_linear=False, untie_embeddings_and_output_weights=False,
                   mamba_ssm_states_dtype="fp32")


def _hybrid_args(**changes) -> argparse.Namespace:
    args = megatron_lm_args(HYBRID, 257)
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def test_hybrid_args_round_trip_with_megatron_lm_names():
    args = vars(megatron_lm_args(HYBRID, 257))
    assert {k: args[k] for k in ("num_layers", "hybrid_layer_pattern", "hybrid_override_pattern", "mamba_state_dim",
                                 "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "position_embedding_type",
                                 "add_position_embedding", "use_rotary_position_embeddings")} == dict(
        num_layers=4, hybrid_layer_pattern="M*M-", hybrid_override_pattern=None, mamba_state_dim=8, mamba_head_dim=16,
        mamba_num_groups=1, mamba_num_heads=None, position_embedding_type="none", add_position_embedding=False,
        use_rotary_position_embeddings=False)
    assert args["mamba_inference_ssm_states_dtype"] is torch.float32 and "mamba_inference_conv_states_dtype" not in args
    assert model_spec_from_args(argparse.Namespace(**args), "ckpt", HYBRID) == HYBRID
    assert "hybrid_layer_pattern" not in vars(megatron_lm_args(LLAMA, 512))


def test_hybrid_checkpoint_args_as_megatron_lm_writes_them():
    """Legacy pattern name, pipeline separators, num_layers from the pattern, Mamba defaults,
    megatron-core's hybrid stack spec, inference state dtypes as Megatron-LM maps them."""
    args = _hybrid_args(hybrid_layer_pattern=None, hybrid_override_pattern="M*|M-", num_layers=9,
                        spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"],
                        mamba_inference_ssm_states_dtype=torch.float32, mamba_inference_conv_states_dtype="bf16")
    for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"):
        delattr(args, name)
    args.hidden_size, args.num_attention_heads = 128, 4  # 2 * 128 / head dim 64 = 4 heads, 8 groups do not divide
    with pytest.raises(CheckpointError, match=r"mamba_num_groups=8 must divide mamba_num_heads=4"):
        model_spec_from_args(args, "--load /ckpt")
    args.hidden_size = 512  # 16 Mamba heads of 64
    spec = model_spec_from_args(args, "--load /ckpt")
    assert (spec.hybrid_layer_pattern, spec.num_layers, spec.mamba_state_dim, spec.mamba_head_dim,
            spec.mamba_num_groups, spec.mamba_num_heads, spec.mamba_chunk_size, spec.mamba_ssm_states_dtype,
            spec.mamba_conv_states_dtype) == ("M*M-", 4, 128, 64, 8, None, 128, "fp32", "bf16")


@pytest.mark.parametrize("changes, named", [
    ({"hybrid_layer_pattern": "M*M-/MM"}, "hybrid_layer_pattern='M*M-/MM' (multi-token prediction layers after '/')"),
    ({"hybrid_override_pattern": "MMMM"},
     "hybrid_layer_pattern='M*M-' and hybrid_override_pattern='MMMM' (two layer patterns)"),
    ({"hybrid_layer_pattern": None, "hybrid_attention_ratio": 0.25},
     "hybrid_attention_ratio=0.25 without hybrid_layer_pattern (a layer pattern Megatron-LM derives from ratios)"),
    ({"hybrid_layer_pattern": None, "is_hybrid_model": True},
     "is_hybrid_model=True without hybrid_layer_pattern (a layer pattern Megatron-LM derives from ratios)"),
    ({"spec": ["my.module", "hybrid_stack_spec_v2"]}, "spec=['my.module', 'hybrid_stack_spec_v2'] (a custom layer spec module)"),
], ids=["mtp", "two-patterns", "ratio", "is-hybrid-model", "custom-spec"])
def test_hybrid_arguments_the_harness_cannot_build_are_refused_by_name(changes, named):
    with pytest.raises(CheckpointError) as info:
        model_spec_from_args(_hybrid_args(**changes), "--load /ckpt")
    assert str(info.value) == f"--load /ckpt: the checkpoint's model has arguments the harness cannot build: {named}"


def test_hybrid_stack_spec_is_refused_for_a_gpt_model():
    with pytest.raises(CheckpointError, match=r"spec=\['megatron.core.models.hybrid.hybrid_layer_specs', "
                                              r"'hybrid_stack_spec'\] \(a custom layer spec module\)$"):
        model_spec_from_args(_args(spec=["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]),
                             "--load /ckpt")
