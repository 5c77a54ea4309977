"""Megatron functional-test cases (``model_config.yaml``) read as ``ab`` cases."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_ext import cli, mcore
from megatron_ext.harness.cases import CaseFileError
from megatron_ext.harness.megatron_case import is_megatron_case_file, load_megatron_case
from megatron_ext.harness.mla import MLA_SERIES

#: Shaped like Megatron-LM's gpt_dynamic_inference_tp1_pp1_583m_prefix_caching_lru case, small.
MODEL_ARGS = {
    "--use-mcore-models": True,
    "--tokenizer-type": "TikTokenizer",
    "--tokenizer-model": "${CHECKPOINT_LOAD_PATH}/vocab.json",
    "--inference-max-seq-length": 256,
    "--attention-backend": "flash",
    "--use-checkpoint-args": True,
    "--load": "${CHECKPOINT_LOAD_PATH}/model",
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--ckpt-format": "torch_dist",
    "--bf16": True,
    "--num-layers": 2,
    "--hidden-size": 64,
    "--num-attention-heads": 4,
    "--max-position-embeddings": 256,
    "--temperature": 1.0,
    "--top_k": 1,
    "--return-log-probs": True,
    "--num-tokens-to-generate": 12,
    "--inference-dynamic-batching-buffer-size-gb": 0.002,
    "--inference-dynamic-batching-block-size": 16,
    "--enable-chunked-prefill": True,
    "--inference-dynamic-batching-max-tokens": 64,
    "--inference-dynamic-batching-prefix-caching": True,
    "--inference-dynamic-batching-prefix-caching-eviction-policy": "lru",
    "--output-path": "${INFERENCE_OUTPUT_PATH}",
    "--prompts": ["Time travel to 2008.", "Time travel to 2009."],
    "--incoming-requests-per-step": 1,
    "--inference-repeat-n": 3,
}


def write(tmp_path: Path, model_args: dict, mode: str = "inference") -> Path:
    directory = tmp_path / "gpt_dynamic_inference_tp1_pp1_tiny_prefix_caching_lru"
    directory.mkdir(exist_ok=True)
    path = directory / "model_config.yaml"
    path.write_text(yaml.safe_dump({"ENV_VARS": {"NCCL_ALGO": "Ring"}, "MODE": mode, "MODEL_ARGS": model_args,
                                    "METRICS": ["logprobs"]}, sort_keys=False))
    return path


def test_every_argument_is_mapped_or_listed_once(tmp_path):
    path = write(tmp_path, MODEL_ARGS)
    assert is_megatron_case_file(str(path))
    mc = load_megatron_case(path, environ={"CHECKPOINT_LOAD_PATH": "/ckpts"})
    case = mc.case
    assert case.name == "gpt_dynamic_inference_tp1_pp1_tiny_prefix_caching_lru"
    assert case.inference.model_dump() == {"block_size_tokens": 16, "buffer_size_gb": 0.002, "max_requests": 16,
                                           "max_tokens": 64, "max_sequence_length": 256,
                                           "enable_chunked_prefill": True, "prefix_caching_mamba_gb": None,
                                           "num_speculative_tokens": 0}
    assert case.prefix_caching_eviction_policies == ["lru"]
    assert (case.sampling.temperature, case.sampling.top_k) == (1.0, 1)
    assert [(r.prompt, r.samples, r.num_tokens_to_generate, r.arrival_step) for r in case.requests] == [
        ("Time travel to 2008.", 3, 12, 0), ("Time travel to 2009.", 3, 12, 1)]
    assert "model" not in case.model_fields_set  # --use-checkpoint-args: the model comes from the checkpoint
    assert (mc.load, mc.use_checkpoint_args) == ("/ckpts/model", True)
    assert mc.tokenizer == ("TikTokenizer", "/ckpts/vocab.json")
    assert [arg for arg, _ in mc.ignored] == [
        "--use-mcore-models", "--attention-backend", "--return-log-probs",
        "--inference-dynamic-batching-prefix-caching", "--output-path"]
    assert mc.unknown_allowed == []
    assert [arg for arg, _ in mc.notes] == ["--inference-repeat-n", "--use-checkpoint-args"]


def test_model_flags_build_the_model_section_without_checkpoint_args(tmp_path):
    args = {k: v for k, v in MODEL_ARGS.items() if k not in ("--use-checkpoint-args", "--load", "--tokenizer-type",
                                                                "--tokenizer-model")}
    case = load_megatron_case(write(tmp_path, args)).case
    assert "model" in case.model_fields_set
    assert (case.model.num_layers, case.model.hidden_size, case.model.num_attention_heads,
            case.model.max_position_embeddings, case.model.params_dtype) == (2, 64, 4, 256, "bf16")


def test_an_unknown_argument_exits_unless_allowed_and_is_then_named(tmp_path):
    path = write(tmp_path, {**MODEL_ARGS, "--some-new-flag": 7, "--another-new-flag": True})
    with pytest.raises(CaseFileError) as error:
        load_megatron_case(path, environ={"CHECKPOINT_LOAD_PATH": "/c"})
    assert str(error.value) == (
        f"{path}: not known to megatron-ext: --some-new-flag, --another-new-flag; ab cannot tell whether they "
        "change the model or the engine, so it would report on a model it may not have built: remove them from a "
        "copy of the file, or run ab --allow-unknown-args (the verdict then names what it ran without)")
    mc = load_megatron_case(path, environ={"CHECKPOINT_LOAD_PATH": "/c"}, allow_unknown=True)
    assert mc.unknown_allowed == ["--some-new-flag", "--another-new-flag"]
    assert "--some-new-flag" not in dict(mc.ignored)


def test_mtp_and_speculative_decoding_map_onto_the_case(tmp_path):
    args = {**MODEL_ARGS, "--use-checkpoint-args": False, "--mtp-num-layers": 1, "--mtp-use-repeated-layer": True,
            "--num-speculative-tokens": 2, "--mtp-loss-scaling-factor": 0.1}
    mc = load_megatron_case(write(tmp_path, args), environ={"CHECKPOINT_LOAD_PATH": "/c"})
    model, inference = mc.case.model, mc.case.inference
    assert (model.mtp_num_layers, model.mtp_use_repeated_layer, inference.num_speculative_tokens) == (1, True, 2)
    assert mc.case.model_features == ["mtp", "speculative:2"]
    assert dict(mc.ignored)["--mtp-loss-scaling-factor"] == "training loss weight of the MTP layers"
    del args["--mtp-use-repeated-layer"]
    with pytest.raises(CaseFileError) as error:
        load_megatron_case(write(tmp_path, args), environ={"CHECKPOINT_LOAD_PATH": "/c"})
    assert "inference.num_speculative_tokens=2 exceeds model.mtp_num_layers=1: megatron-core drafts one token " \
           "per MTP layer; raise mtp_num_layers or set mtp_use_repeated_layer: true" in str(error.value)


def test_block_size_defaults_to_megatrons(tmp_path):
    args = {k: v for k, v in MODEL_ARGS.items() if k != "--inference-dynamic-batching-block-size"}
    assert load_megatron_case(write(tmp_path, args), environ={"CHECKPOINT_LOAD_PATH": "/c"}).case.inference.block_size_tokens == 256


@pytest.mark.parametrize("change, message", [
    ({"--num-experts": 4, "--moe-grouped-gemm": True, "--expert-model-parallel-size": 2},
     "refused: --moe-grouped-gemm (of the mixture-of-experts arguments ab builds --num-experts, --moe-router-topk, "
     "--moe-ffn-hidden-size and --moe-enable-routing-replay only); --expert-model-parallel-size (expert "
     "parallelism is not supported by ab (experts on every rank))"),
    ({"--fp16": True}, "refused: --fp16 (ab runs bf16 or fp32)"),
    ({"--mtp-num-layers": 1, "--mtp-hybrid-override-pattern": "M"},
     "refused: --mtp-hybrid-override-pattern (MTP layers of a hybrid model are not supported by ab (GPT MTP "
     "layers are))"),
    ({"--use-checkpoint-args": False, "--num-speculative-tokens": 2}, "field '<top>': Value error, inference.num_speculative_tokens=2 needs MTP "
                                      "layers to draft them: set model.mtp_num_layers"),
    ({"--ckpt-format": "torch"}, "--ckpt-format torch: ab loads torch_dist checkpoints only"),
    ({"--incoming-requests-per-sec": 10}, "--incoming-requests-per-sec > 0 draws random arrival times"),
    ({"--inference-dynamic-batching-buffer-size-gb": 20}, "--inference-dynamic-batching-buffer-size-gb 20.0 would "
                                                          "allocate that much CPU memory"),
    ({"--prompts": None}, "no --prompts or --prompt-file"),
    ({"--top_k": "many"}, "--top_k: 'many' is not a valid value"),
])
def test_refusals_name_the_argument(tmp_path, change, message):
    args = {k: v for k, v in {**MODEL_ARGS, **change}.items() if v is not None}
    with pytest.raises(CaseFileError) as error:
        load_megatron_case(write(tmp_path, args), environ={"CHECKPOINT_LOAD_PATH": "/c"})
    assert message in str(error.value)


def test_unset_variable_is_named_unless_the_argument_is_overridden(tmp_path):
    path = write(tmp_path, MODEL_ARGS)
    with pytest.raises(CaseFileError, match=r"--load uses \$\{CHECKPOINT_LOAD_PATH\}, which is not set"):
        load_megatron_case(path, environ={})
    args = {k: v for k, v in MODEL_ARGS.items() if not k.startswith("--tokenizer")}
    mc = load_megatron_case(write(tmp_path, args), environ={}, load_given=True)
    assert mc.load is None and dict(mc.ignored)["--load"] == "ab --load DIR given on the command line"


def test_mode_other_than_inference_is_refused(tmp_path):
    with pytest.raises(CaseFileError, match="MODE 'pretraining': ab runs inference cases only"):
        load_megatron_case(write(tmp_path, MODEL_ARGS, mode="pretraining"))


def test_tokenizer_arguments_become_ab_tokenizer_arguments(tmp_path, capsys, monkeypatch):
    from megatron_ext.harness.megatron_case import megatron_tokenizer

    assert megatron_tokenizer(("HuggingFaceTokenizer", "/t/dir"), "x") == ("/t/dir", "huggingface")
    assert megatron_tokenizer(("TikTokenizer", "/t/v.json"), "x") == ("/t/v.json", "tiktoken")
    with pytest.raises(CaseFileError, match="--tokenizer-type GPT2BPETokenizer: ab loads HuggingFaceTokenizer"):
        megatron_tokenizer(("GPT2BPETokenizer", "/t/vocab"), "x")
    # through the CLI: the file's tokenizer is loaded like ab --tokenizer, and a missing one is one line
    monkeypatch.setenv("CHECKPOINT_LOAD_PATH", str(tmp_path))
    assert cli.main(["ab", "--case", str(write(tmp_path, MODEL_ARGS)), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron-ext: error: --tokenizer {tmp_path}/vocab.json: no such file or directory"]


def test_llama_style_model_flags_map_to_the_model_section(tmp_path):
    args = {k: v for k, v in MODEL_ARGS.items() if k not in ("--use-checkpoint-args", "--load", "--tokenizer-type",
                                                                "--tokenizer-model")}
    args.update({"--normalization": "RMSNorm", "--swiglu": True, "--position-embedding-type": "rope",
                 "--rotary-base": 500000, "--disable-bias-linear": True, "--group-query-attention": True,
                 "--num-query-groups": 2, "--untie-embeddings-and-output-weights": True})
    model = load_megatron_case(write(tmp_path, args)).case.model
    assert (model.normalization, model.swiglu, model.position_embedding_type, model.rotary_base,
            model.add_bias_linear, model.num_query_groups, model.untie_embeddings_and_output_weights) == (
        "RMSNorm", True, "rope", 500000, False, 2, True)
    del args["--untie-embeddings-and-output-weights"]
    assert load_megatron_case(write(tmp_path, args)).case.model.untie_embeddings_and_output_weights is False


def test_query_groups_only_with_group_query_attention_and_layout_only_when_given(tmp_path):
    args = {k: v for k, v in MODEL_ARGS.items() if k not in ("--use-checkpoint-args", "--load", "--tokenizer-type",
                                                                "--tokenizer-model", "--tensor-model-parallel-size",
                                                                "--pipeline-model-parallel-size")}
    mc = load_megatron_case(write(tmp_path, {**args, "--num-query-groups": 2}))
    assert mc.case.model.num_query_groups is None  # Megatron-LM ignores it without the flag
    assert (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size) == (None, None)
    gqa = load_megatron_case(write(tmp_path, {**args, "--num-query-groups": 2, "--group-query-attention": True}))
    assert gqa.case.model.num_query_groups == 2


#: A tiny multi-latent attention model as a Megatron-LM run gives it (sizes, RoPE, the latent cache).
MLA_ARGS = {
    **{k: v for k, v in MODEL_ARGS.items() if k not in ("--use-checkpoint-args", "--load", "--tokenizer-type",
                                                          "--tokenizer-model", "--enable-chunked-prefill")},
    "--normalization": "RMSNorm", "--position-embedding-type": "rope", "--disable-bias-linear": True,
    "--qk-layernorm": True, "--multi-latent-attention": True, "--q-lora-rank": 32, "--kv-lora-rank": 24, "--qk-head-dim": 16,
    "--qk-pos-emb-head-dim": 8, "--v-head-dim": 12, "--rope-type": "rope", "--cache-mla-latents": True,
    "--inference-dynamic-batching-block-size": 64,
}
MLA_RELEASE = mcore.release_series(mcore.installed_version()) in MLA_SERIES


def test_multi_latent_attention_arguments_map_to_the_model_section_or_are_refused_by_release(tmp_path):
    if not MLA_RELEASE:  # 0.17: refused by name before the model section is built
        with pytest.raises(CaseFileError) as error:
            load_megatron_case(write(tmp_path, MLA_ARGS))
        assert str(error.value).endswith(
            f"refused: --multi-latent-attention (megatron-core {mcore.installed_version()} cannot run multi-latent "
            "attention with prefix caching; use 0.18 or 0.19)")
        return
    mc = load_megatron_case(write(tmp_path, MLA_ARGS))
    model = mc.case.model
    assert (model.multi_latent_attention, model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim,
            model.qk_pos_emb_head_dim, model.v_head_dim, model.position_embedding_type, model.qk_layernorm,
            model.features) == (True, 32, 24, 16, 8, 12, "rope", True, ["mla"])
    assert mc.case.inference.block_size_tokens == 64
    assert not ({"--multi-latent-attention", "--rope-type", "--cache-mla-latents"} & {a for a, _ in mc.ignored})
    # sizes the file leaves out take Megatron-LM's defaults, not the model section's
    sizes = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim")
    # (without --qk-layernorm: no query compression with query norms is refused, see test_cases.py)
    bare = load_megatron_case(write(tmp_path, {k: v for k, v in MLA_ARGS.items()
                                               if k not in (*sizes, "--qk-layernorm")})).case.model
    assert (bare.q_lora_rank, bare.kv_lora_rank, bare.qk_head_dim, bare.qk_pos_emb_head_dim, bare.v_head_dim) == (
        None, 32, 128, 64, 128)


def test_multi_latent_attention_without_rope_type_builds_yarn_as_megatron_does(tmp_path):
    """No ``--rope-type``: megatron-core's ``MLATransformerConfig`` default, yarn, with Megatron-LM's
    ``--rotary-scaling-factor`` / ``--mscale`` / ``--mscale-all-dim`` defaults (1.0, 1.0, 0.0) and
    megatron-core's for the YaRN fields Megatron-LM has no MLA argument for; the model is built with
    megatron-core's ``YarnRotaryEmbedding`` on the CPU."""
    if not MLA_RELEASE:
        pytest.skip("megatron-core 0.17 refuses --multi-latent-attention (tested above)")
    from megatron_ext.cpu_backend import cpu_backend
    from megatron_ext.harness.engine import build_model, ensure_model_parallel

    args = {k: v for k, v in MLA_ARGS.items() if k != "--rope-type"}
    mc = load_megatron_case(write(tmp_path, {**args, "--yarn-beta-fast": 16}))
    model = mc.case.model
    assert (model.rope_type, model.rotary_scaling_factor, model.mscale, model.mscale_all_dim,
            model.original_max_position_embeddings, model.beta_fast, model.beta_slow) == ("yarn", 1.0, 1.0, 0.0,
                                                                                         4096, 32, 1)
    assert dict(mc.ignored)["--yarn-beta-fast"].startswith("Megatron-LM passes the --yarn-* arguments to a GPT "
                                                          "model's YaRN")
    given = load_megatron_case(write(tmp_path, {**args, "--rotary-scaling-factor": 40, "--mscale": 0.707,
                                                "--mscale-all-dim": 0.707})).case.model
    assert (given.rope_type, given.rotary_scaling_factor, given.mscale, given.mscale_all_dim) == ("yarn", 40, 0.707,
                                                                                                  0.707)
    with cpu_backend():
        ensure_model_parallel()
        built = build_model(mc.case)
    yarn = mcore.import_module("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    config = built.config
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (
        "yarn", 1.0, 1.0, 0.0)
    assert type(built.decoder.layers[0].self_attention.rotary_pos_emb) is yarn.YarnRotaryEmbedding
    rope = load_megatron_case(write(tmp_path, MLA_ARGS)).case.model
    assert rope.rope_type == "rope"


@pytest.mark.parametrize("change, message", [
    ({"--rope-type": "ntk"}, "--rope-type ntk: Megatron-LM's choices are rope and yarn"),
    ({"--cache-mla-latents": False}, "--cache-mla-latents false: megatron-core's dynamic engine runs multi-latent "
                                     "attention with cached latents only"),
    ({"--inference-dynamic-batching-block-size": 16}, "--multi-latent-attention needs "
                                                      "--inference-dynamic-batching-block-size 64"),
])
def test_multi_latent_attention_refusals_name_the_argument(tmp_path, change, message):
    args = {k: v for k, v in {**MLA_ARGS, **change}.items() if v is not None}
    with pytest.raises(CaseFileError) as error:
        load_megatron_case(write(tmp_path, args))
    assert (message if MLA_RELEASE else "refused: --multi-latent-attention (megatron-core") in str(error.value)


def test_multi_latent_attention_sizes_without_the_flag_are_refused(tmp_path):
    args = {k: v for k, v in MLA_ARGS.items() if k not in ("--multi-latent-attention", "--rope-type",
                                                              "--cache-mla-latents")}
    gpt = {k: v for k, v in args.items() if k not in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                                                      "--qk-pos-emb-head-dim", "--v-head-dim")}
    assert "--rope-type" not in {a for a, _ in load_megatron_case(write(tmp_path, {**gpt, "--rope-type": "rope"})).ignored}
    with pytest.raises(CaseFileError, match="--rope-type yarn without --multi-latent-attention: Megatron-LM asserts "
                                            "common attention only supports rope_type rope"):
        load_megatron_case(write(tmp_path, {**gpt, "--rope-type": "yarn"}))
    with pytest.raises(CaseFileError) as error:
        load_megatron_case(write(tmp_path, args))
    assert str(error.value).endswith(": --q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, "
                                     "--v-head-dim without --multi-latent-attention: Megatron-LM uses them only "
                                     "with it; add it or remove them")


#: Shaped like Megatron-LM's hybrid_dynamic_inference_tp1_pp1_dp8_583m_chunked_prefill case, tiny.
HYBRID_ARGS = {
    **{k: v for k, v in MODEL_ARGS.items() if k not in ("--use-checkpoint-args", "--load", "--tokenizer-type",
                                                          "--tokenizer-model", "--num-layers", "--bf16")},
    "--model-provider": "hybrid",
    "--transformer-impl": "transformer_engine",
    "--hybrid-layer-pattern": "M*|M-",
    "--spec": "megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec",
    "--position-embedding-type": "none",
    "--normalization": "RMSNorm",
    "--disable-bias-linear": True,
    "--mamba-state-dim": 8,
    "--mamba-head-dim": 16,
    "--mamba-num-groups": 1,
    "--mamba-inference-ssm-states-dtype": "fp32",
}


def test_hybrid_model_flags_map_to_the_model_section(tmp_path):
    mc = load_megatron_case(write(tmp_path, HYBRID_ARGS))
    model = mc.case.model
    assert (model.hybrid_layer_pattern, model.num_layers, model.mamba_state_dim, model.mamba_head_dim,
            model.mamba_num_groups, model.position_embedding_type, model.params_dtype) == (
        "M*M-", 4, 8, 16, 1, "none", "fp32")
    # given: fp32; absent: Megatron-LM's default, bf16
    assert (model.mamba_ssm_states_dtype, model.mamba_conv_states_dtype) == ("fp32", "bf16")
    ignored = dict(mc.ignored)
    assert "--spec" not in ignored and "--hybrid-layer-pattern" not in ignored
    assert ignored["--model-provider"].startswith("ab builds a hybrid model when the file gives --hybrid-layer-pattern")


def test_older_pattern_name_and_num_layers_follow_megatron_lm(tmp_path):
    args = {k: v for k, v in HYBRID_ARGS.items() if k != "--hybrid-layer-pattern"}
    model = load_megatron_case(write(tmp_path, {**args, "--hybrid-override-pattern": "MM*",
                                                "--num-layers": 7})).case.model
    assert (model.hybrid_layer_pattern, model.num_layers) == ("MM*", 3)


@pytest.mark.parametrize("change, message", [
    ({"--hybrid-override-pattern": "MMMM"}, "--hybrid-layer-pattern and --hybrid-override-pattern both given"),
    ({"--hybrid-layer-pattern": "M*M-/MM"}, "multi-token prediction layers (after '/') are not supported by ab"),
    ({"--spec": "my.module my_hybrid_spec"}, "refused: --spec (a custom layer spec"),
    ({"--hybrid-layer-pattern": None}, "refused: --spec (a custom layer spec"),
    ({"--hybrid-attention-ratio": 0.25}, "refused: --hybrid-attention-ratio (a layer pattern derived from ratios"),
    ({"--mamba-inference-conv-states-dtype": "fp16"}, "--mamba-inference-conv-states-dtype fp16: ab runs bf16 or fp32"),
    ({"--spec": None, "--hybrid-layer-pattern": None}, "mamba_state_dim applies to hybrid models only"),
], ids=["two-patterns", "mtp", "custom-spec", "spec-without-pattern", "ratio", "fp16-states", "mamba-sizes-alone"])
def test_hybrid_refusals_name_the_argument(tmp_path, change, message):
    args = {k: v for k, v in {**HYBRID_ARGS, **change}.items() if v is not None}
    with pytest.raises(CaseFileError) as error:
        load_megatron_case(write(tmp_path, args))
    assert message in str(error.value)


def test_mixture_of_experts_arguments_build_the_moe_model(tmp_path):
    args = {**{k: v for k, v in MODEL_ARGS.items() if k not in ("--use-checkpoint-args", "--load")},
            "--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 96,
            "--moe-enable-routing-replay": True, "--moe-aux-loss-coeff": 0.01}
    mc = load_megatron_case(write(tmp_path, args), environ={"CHECKPOINT_LOAD_PATH": "/c"})
    model = mc.case.model
    assert (model.num_experts, model.moe_router_topk, model.moe_ffn_hidden_size) == (4, 2, 96)
    assert model.moe_enable_routing_replay is True
    assert model.features == ["moe", "routing_replay"]
    assert ("--moe-aux-loss-coeff", "a training loss (ab builds the router without load balancing: inference)") in mc.ignored


#: MODEL_ARGS with the model from the file's flags (no checkpoint): seeded random weights.
SEEDED_ARGS = {k: v for k, v in MODEL_ARGS.items()
               if k not in ("--use-checkpoint-args", "--load", "--tokenizer-type", "--tokenizer-model")}


def _weights(case):
    from megatron_ext.cpu_backend import cpu_backend
    from megatron_ext.harness.engine import build_model, ensure_model_parallel
    from megatron_ext.harness.weight_updates import weights_sha256

    with cpu_backend():
        ensure_model_parallel()
        model = build_model(case)
    return weights_sha256(model), model.embedding.word_embeddings.weight.detach().clone()


def test_seed_builds_the_weights_of_a_case_with_that_seed(tmp_path):
    """``--seed 4321`` is the model section's ``seed``: the weights equal those of the same case
    with ``seed: 4321`` and differ from the default seed's (1234, Megatron-LM's default too)."""
    seeded = load_megatron_case(write(tmp_path, {**SEEDED_ARGS, "--seed": 4321})).case
    default = load_megatron_case(write(tmp_path, SEEDED_ARGS)).case
    assert (seeded.model.seed, default.model.seed) == (4321, 1234)
    assert seeded.model.model_dump() == {**default.model.model_dump(), "seed": 4321}
    case_yaml = default.model_copy(update={"model": default.model.model_copy(update={"seed": 4321})})
    (sha_file, emb_file), (sha_case, emb_case), (sha_default, emb_default) = (
        _weights(seeded), _weights(case_yaml), _weights(default))
    assert sha_file == sha_case and torch_equal(emb_file, emb_case)
    assert sha_file != sha_default and not torch_equal(emb_file, emb_default)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_seed_alone_sets_only_the_seed_and_with_checkpoint_args_is_a_note(tmp_path):
    only_seed = {k: v for k, v in SEEDED_ARGS.items()
                 if k not in ("--bf16", "--num-layers", "--hidden-size", "--num-attention-heads",
                              "--max-position-embeddings")}
    case = load_megatron_case(write(tmp_path, {**only_seed, "--seed": 7})).case
    assert case.model.model_dump() == {**case.model.__class__().model_dump(), "seed": 7}
    mc = load_megatron_case(write(tmp_path, {**MODEL_ARGS, "--seed": 7}), environ={"CHECKPOINT_LOAD_PATH": "/c"})
    assert "model" not in mc.case.model_fields_set
    assert dict(mc.notes)["--seed"] == ("the weights come from the checkpoint (--use-checkpoint-args); no seeded "
                                        "weights are built")
    assert "--seed" not in dict(mc.ignored) and mc.unknown_allowed == []


#: Arguments of Megatron-LM's functional-test configs that change neither the model nor the engine.
STANDARD_ARGS = {
    "--deterministic-mode": True, "--log-interval": 1, "--log-params-norm": True, "--log-num-zeros-in-grad": True,
    "--log-validation-ppl-to-tensorboard": True, "--log-timers-to-tensorboard": True,
    "--log-memory-to-tensorboard": True, "--tiktoken-pattern": "v2", "--tiktoken-num-special-tokens": 1000,
    "--tensorboard-dir": "${TENSORBOARD_PATH}", "--timing-log-level": 0, "--wandb-project": "megatron",
    "--wandb-exp-name": "x", "--save": "${CHECKPOINT_SAVE_PATH}", "--save-interval": 1000, "--exit-interval": 1000,
    "--distributed-backend": "nccl", "--attention-backend": "flash", "--no-gradient-accumulation-fusion": True,
    "--micro-batch-size": 1, "--global-batch-size": 8, "--lr": 0.0001, "--train-iters": 10,
}


def test_standard_arguments_that_change_neither_model_nor_engine_are_listed_as_ignored(tmp_path):
    mc = load_megatron_case(write(tmp_path, {**SEEDED_ARGS, **STANDARD_ARGS}))  # unset variables never expanded
    assert mc.unknown_allowed == []
    ignored = dict(mc.ignored)
    assert set(STANDARD_ARGS) <= set(ignored)
    logging, training = "logging, timers and experiment tracking", ("training only (ab runs no training loop: its "
                                                                     "weight updates come from the case)")
    assert {arg: ignored[arg] for arg in STANDARD_ARGS} == {
        **{arg: logging for arg in STANDARD_ARGS if arg.startswith(("--log-", "--tensorboard-", "--wandb-",
                                                                     "--timing-"))},
        **{arg: training for arg in ("--exit-interval", "--no-gradient-accumulation-fusion", "--global-batch-size",
                                     "--lr", "--train-iters")},
        "--micro-batch-size": training,
        "--save": "checkpoint saving (ab saves nothing)", "--save-interval": "checkpoint saving (ab saves nothing)",
        **{arg: ("tokenizer settings of TikTokenizer: ab loads it with megatron-core's defaults (pattern v2, 1000 "
                 "special tokens); they change the prompts' token IDs, not the model or the engine")
           for arg in ("--tiktoken-pattern", "--tiktoken-num-special-tokens")},
        "--deterministic-mode": "a GPU kernel setting, ab checks batch invariance itself on the CPU",
        "--distributed-backend": "ab runs CPU ranks over gloo",
        "--attention-backend": "GPU kernel choice, the CPU backend has one reference attention",
    }
    assert len(mc.ignored) == len(ignored)  # each listed once


def test_an_unknown_model_changing_argument_is_still_refused(tmp_path):
    path = write(tmp_path, {**SEEDED_ARGS, **STANDARD_ARGS, "--seed": 4321, "--rotary-scaling-factor": 8})
    with pytest.raises(CaseFileError) as error:
        load_megatron_case(path)
    assert str(error.value) == (
        f"{path}: not known to megatron-ext: --rotary-scaling-factor; ab cannot tell whether it changes the model or "
        "the engine, so it would report on a model it may not have built: remove it from a copy of the file, or run "
        "ab --allow-unknown-args (the verdict then names what it ran without)")
