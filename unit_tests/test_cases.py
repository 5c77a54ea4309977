"""Case files: shipped cases load and expand as documented; malformed files name the bad field."""

from __future__ import annotations

import pytest

from megatron_ext.harness.cases import (
    CaseFileError, PlannedRequest, dump_case, RequestSpec, WorkloadError, load_case, parse_case, plan_requests,
    shipped_cases, validate_planned,
)
from megatron_ext.harness.tokenizer import default_tokenizer

TOKENIZER = default_tokenizer()


def test_shipped_cases():
    assert shipped_cases() == [
        "chunked_prefill", "hybrid_chunked", "hybrid_prefix", "lru_pressure", "memory_pressure", "mla_tiny",
        "mla_yarn_tiny", "moe_mla_mtp_tiny", "moe_tiny", "mtp_evict_resume", "mtp_speculative_tiny", "multi_turn_chat",
        "rl_rollouts", "rl_weight_update", "shared_system_prompt",
    ]


@pytest.mark.parametrize("name, lengths, arrivals", [
    # prompt ends on block boundaries (32, 80) where later requests restore the Mamba state
    ("hybrid_prefix", [32, 80, 86, 65, 16], [0, 1, 2, 2, 2]),
    # a one-block prompt (its only Mamba snapshot is its end), then two longer than a 64-token step
    ("hybrid_chunked", [16, 101, 63], [0, 1, 1]),
])
def test_hybrid_cases_plan_as_documented(name, lengths, arrivals):
    case = load_case(name)
    assert case.model.is_hybrid and case.model.hybrid_layer_pattern == "M*M"
    assert case.model.mamba_chunk_size == case.inference.block_size_tokens == 16  # restores on the chunk grid
    assert (case.model.params_dtype, case.model.mamba_ssm_states_dtype) == ("fp32", "fp32")
    assert case.prefix_caching_eviction_policies == ["ref_zero", "lru"]
    planned = plan_requests(case, TOKENIZER)
    assert [len(p.prompt_tokens) for p in planned] == lengths
    assert [p.arrival_step for p in planned] == arrivals
    first = planned[0].prompt_tokens
    assert all(p.prompt_tokens[:len(first) // 2] == first[:len(first) // 2] for p in planned)  # a shared prefix


def test_rl_rollouts_expands_samples_with_block_multiple_and_odd_lengths():
    planned = plan_requests(load_case("rl_rollouts"), TOKENIZER)
    assert [len(p.prompt_tokens) for p in planned] == [48] * 4 + [32] * 4 + [60] * 4 + [48] * 2
    assert [p.arrival_step for p in planned] == [0] * 12 + [12, 12]
    assert planned[0].prompt_tokens == planned[13].prompt_tokens
    assert [p.label for p in planned[:2]] == ["r0.s0", "r0.s1"]


def test_conversation_turns_extend_the_previous_prompt():
    case = parse_case(
        "name: c\nrequests:\n  - conversation: ['ab', 'cd', 'ef']\n    turn_interval: 3\n"
    )
    planned = plan_requests(case, TOKENIZER)
    assert [TOKENIZER.detokenize(p.prompt_tokens) for p in planned] == ["ab", "abcdef"]
    assert [p.arrival_step for p in planned] == [0, 3]


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: x\nrequests: []\n", "field 'requests': List should have at least 1 item"),
        ("name: x\nrequests:\n  - {prompt: hi, samples: zero}\n", "field 'requests.0.samples'"),
        ("name: x\nrequests:\n  - {prompt: hi, sample: 2}\n", "field 'requests.0.sample': Extra inputs"),
        ("name: x\nrequests:\n  - {samples: 2}\n", "give exactly one of 'prompt' or 'conversation'"),
        ("name: x\ninference: {block_size_tokens: 0}\nrequests: [{prompt: hi}]\n",
         "field 'inference.block_size_tokens'"),
        ("name: x\nprefix_caching_eviction_policies: [fifo]\nrequests: [{prompt: hi}]\n",
         "field 'prefix_caching_eviction_policies.0'"),
        ("requests: [{prompt: hi}]\n", "field 'name': Field required"),
        ("name: x\nrequests: [{prompt: hi\n", "not valid YAML"),
        ("- just a list\n", "expected a mapping"),
        ("name: x\nmodel: {num_layers: 2}\ninference: {num_speculative_tokens: 1}\nrequests: [{prompt: hi}]\n",
         "inference.num_speculative_tokens=1 needs MTP layers to draft them: set model.mtp_num_layers"),
        ("name: x\nmodel: {mtp_num_layers: 1}\ninference: {num_speculative_tokens: 2}\nrequests: [{prompt: hi}]\n",
         "inference.num_speculative_tokens=2 exceeds model.mtp_num_layers=1: megatron-core drafts one token per "
         "MTP layer; raise mtp_num_layers or set mtp_use_repeated_layer: true"),
        ("name: x\nmodel: {mtp_num_layers: 1, mtp_use_repeated_layer: true}\n"
         "inference: {num_speculative_tokens: 4, block_size_tokens: 4}\nrequests: [{prompt: hi}]\n",
         "inference.num_speculative_tokens=4 must be below block_size_tokens=4"),
        ("name: x\nmodel: {mtp_num_layers: 0}\nrequests: [{prompt: hi}]\n", "field 'model.mtp_num_layers'"),
    ],
)
def test_malformed_case_names_the_problem(text, message):
    with pytest.raises(CaseFileError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_case(text, "case.yaml")


def test_mtp_speculative_tiny_plans_shared_prefixes_and_features():
    case = load_case("mtp_speculative_tiny")
    assert (case.model.mtp_num_layers, case.model.mtp_use_repeated_layer, case.inference.num_speculative_tokens,
            case.inference.block_size_tokens) == (1, True, 2, 8)
    assert case.model.features == ["mtp"] and case.model_features == ["mtp", "speculative:2"]
    assert load_case("rl_rollouts").model_features == []
    planned = plan_requests(case, TOKENIZER)
    assert [len(p.prompt_tokens) for p in planned] == [21, 21, 24, 24, 24, 30]
    assert [p.arrival_step for p in planned] == [0, 0, 0, 0, 3, 6]
    assert planned[4].prompt_tokens[:16] == planned[0].prompt_tokens[:16]  # 2 shared blocks
    assert planned[5].prompt_tokens[:24] == planned[2].prompt_tokens  # 3 shared blocks


def test_moe_mla_mtp_tiny_combines_moe_mla_and_mtp_with_spelled_out_arrivals():
    case = load_case("moe_mla_mtp_tiny")
    assert case.model_features == ["moe", "routing_replay", "mla", "mtp", "speculative:2"]
    assert (case.model.num_experts, case.model.moe_router_topk, case.model.moe_ffn_hidden_size,
            case.model.mtp_num_layers, case.model.mtp_use_repeated_layer, case.inference.num_speculative_tokens,
            case.inference.block_size_tokens, case.inference.enable_chunked_prefill) == (4, 2, 64, 1, True, 2, 64, False)
    assert parse_case(dump_case(case)) == case
    planned = plan_requests(case, TOKENIZER)
    assert [len(p.prompt_tokens) for p in planned] == [147, 71, 147, 128, 144, 139]
    assert [p.arrival_step for p in planned] == [0, 0, 1, 2, 4, 52]  # no samples: the same step kinds on and off
    assert all(p.prompt_tokens[:128] == planned[3].prompt_tokens for p in planned if p.request_id != 1)  # 2 blocks
    assert planned[2].prompt_tokens == planned[0].prompt_tokens


def test_prompt_longer_than_max_sequence_length_is_refused():
    case = parse_case("name: x\ninference: {max_sequence_length: 10}\nrequests: [{prompt: abcdefgh}]\n")
    with pytest.raises(CaseFileError, match=r"requests.0.*8 tokens \+ 8 generated = 16 exceeds"):
        plan_requests(case, TOKENIZER)


def test_unknown_case_name_lists_the_shipped_ones(tmp_path):
    with pytest.raises(CaseFileError, match="no case named 'nope'; shipped cases: chunked_prefill"):
        load_case("nope")
    with pytest.raises(CaseFileError, match="cannot read case file"):
        load_case(str(tmp_path / "missing.yaml"))
    truncated = tmp_path / "t.yaml"
    truncated.write_text("name: t\nrequests:\n  - {prompt: 'unterminated\n")
    with pytest.raises(CaseFileError, match=f"{truncated}: not valid YAML"):
        load_case(str(truncated))


# -- bad input: zero-token prompts and repeated request IDs, refused before any engine exists ----

@pytest.mark.parametrize(
    "requests, message",
    [
        ("[{prompt: ''}]", r"field 'requests.0': Value error, empty prompt: 'prompt' and 'prefix' are both empty.*"
                           r"write at least one character in 'prompt'"),
        ("[{prompt: hi}, {conversation: ['', 'reply', 'more']}]",
         r"field 'requests.1': Value error, empty prompt: the first turn 'conversation.0' is empty.*"
         r"write at least one character in 'conversation.0'"),
    ],
)
def test_empty_prompt_in_a_case_file_is_refused_naming_the_field(tmp_path, requests, message):
    path = tmp_path / "empty.yaml"
    path.write_text(f"name: x\nrequests: {requests}\n")
    with pytest.raises(CaseFileError, match=f"{path}: {message}"):
        load_case(str(path))


def test_empty_prompt_with_a_prefix_is_a_prompt():
    case = parse_case("name: x\nrequests: [{prefix: 'System: hi. ', prompt: ''}]\n")
    assert [TOKENIZER.detokenize(p.prompt_tokens) for p in plan_requests(case, TOKENIZER)] == ["System: hi. "]


def test_plan_requests_refuses_an_unvalidated_empty_prompt():
    case = parse_case("name: x\nrequests: [{prompt: a}, {prompt: b}]\n")
    bad = case.model_copy(update={"requests": [case.requests[0], RequestSpec.model_construct(
        prompt="", prefix="", conversation=None, turn_interval=2, samples=1, arrival_step=0,
        num_tokens_to_generate=4)]})
    with pytest.raises(CaseFileError, match=r"field 'requests.1': 'prompt' \(with 'prefix'\) has 0 tokens"):
        plan_requests(bad, TOKENIZER)


def _planned(request_id, tokens, label="r"):
    return PlannedRequest(request_id=request_id, arrival_step=0, prompt_tokens=tokens,
                          num_tokens_to_generate=4, label=label)


@pytest.mark.parametrize(
    "planned, message",
    [
        ([_planned(0, [1]), _planned(1, [], "r1.s0")],
         r"planned request 1 \(request_id 1, 'r1.s0'\) has an empty prompt \(0 tokens\).*at least one token"),
        ([_planned(5, [1]), _planned(6, [2]), _planned(5, [3])],
         r"planned requests 0 and 2 share request_id 5;.*give every request its own request_id"),
    ],
)
def test_validate_planned_refuses_empty_prompts_and_repeated_ids(planned, message):
    with pytest.raises(WorkloadError, match=message):
        validate_planned(planned)
    validate_planned([_planned(0, [1]), _planned(1, [1])])  # same prompt, own IDs: fine


class _Untouchable:
    """An engine / context stand-in: any use fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the engine or context was used ('{name}') before the input was validated")


@pytest.mark.parametrize("planned", [[_planned(0, [])], [_planned(3, [1]), _planned(3, [2])]],
                         ids=["empty-prompt", "repeated-id"])
def test_drive_refuses_bad_requests_before_touching_the_engine(planned):
    from megatron_ext.harness.step_loop import RunRecord, drive

    with pytest.raises(WorkloadError):
        drive(_Untouchable(), _Untouchable(), parse_case("name: x\nrequests: [{prompt: a}]\n"), planned,
              RunRecord(False, None))


def test_ab_with_an_empty_prompt_case_exits_2_before_building_anything(tmp_path, monkeypatch, capsys):
    from megatron_ext import cli
    from megatron_ext.harness import ab

    for name in ("build_model", "build_engine", "backend", "apply"):
        monkeypatch.setattr(ab, name, lambda *a, **k: pytest.fail("built something before refusing the case"))
    path = tmp_path / "empty.yaml"
    path.write_text("name: x\nrequests: [{conversation: ['']}]\n")
    assert cli.main(["ab", "--case", str(path), "--no-progress"]) == 2
    assert "field 'requests.0': Value error, empty prompt" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["ab", "--json"], ["ab", "--plot"], ["soak", "--requests", "5", "--json"],
                                     ["soak", "--requests", "5", "--dump-case"]])
def test_output_path_in_a_missing_directory_exits_2_before_running(tmp_path, monkeypatch, capsys, command):
    from megatron_ext import cli
    from megatron_ext.harness import ab

    for name in ("build_model", "build_engine", "backend", "apply", "run_ab"):
        monkeypatch.setattr(ab, name, lambda *a, **k: pytest.fail("ran something before refusing the path"))
    target = tmp_path / "missing" / "out.json"
    assert cli.main([*command, str(target), "--no-progress"]) == 2
    assert f"{command[-1]} {target}: directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err


_HYBRID = "name: h\nrequests: [{prompt: hi}]\nmodel: {%s}\n"


@pytest.mark.parametrize("model, message", [
    ("hybrid_layer_pattern: 'M*X'", "hybrid_layer_pattern 'M*X': use one symbol per layer from M (Mamba), "
                                    "* (attention), - (MLP); 'X' is not one"),
    ("hybrid_layer_pattern: ''", "hybrid_layer_pattern '': use one symbol per layer"),
    ("hybrid_layer_pattern: '*-'", "has no Mamba layer ('M')"),
    ("hybrid_layer_pattern: 'M*M', num_layers: 2", "num_layers=2 but hybrid_layer_pattern 'M*M' has 3 layers"),
    ("hybrid_layer_pattern: 'M*M', mamba_head_dim: 24", "mamba_head_dim=24 must divide 2 * hidden_size = 128"),
    ("hybrid_layer_pattern: 'M*M', mamba_num_groups: 3", "mamba_num_groups=3 must divide mamba_num_heads=8"),
    ("hybrid_layer_pattern: 'M*M', mamba_chunk_size: 0", "field 'model.mamba_chunk_size'"),
    ("mamba_state_dim: 8", "mamba_state_dim applies to hybrid models only; set hybrid_layer_pattern"),
])
def test_bad_hybrid_model_fields_are_refused_in_one_line(model, message):
    with pytest.raises(CaseFileError) as raised:
        parse_case(_HYBRID % model)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_hybrid_model_fills_num_layers_and_round_trips():
    case = parse_case(_HYBRID % "hybrid_layer_pattern: 'M*M-', mamba_chunk_size: 16")
    assert case.model.is_hybrid and case.model.num_layers == 4
    assert case.model.effective_mamba_num_heads() == 2 * 64 // 16
    assert parse_case(dump_case(case)) == case
    gpt = parse_case(_HYBRID % "num_layers: 2")
    assert not gpt.model.is_hybrid and parse_case(dump_case(gpt)) == gpt


_MLA = ("name: m\nrequests: [{prompt: hi}]\ninference: {block_size_tokens: %s}\n"
        "model: {position_embedding_type: rope, multi_latent_attention: true, %s}\n")


@pytest.mark.parametrize("block, model, message", [
    (16, "kv_lora_rank: 32", "inference.block_size_tokens is 16 but a multi_latent_attention model's latent KV cache "
                             "needs 64 (megatron-core asserts it); set block_size_tokens: 64"),
    (64, "position_embedding_type: learned_absolute", "multi_latent_attention: position_embedding_type must be rope"),
    (64, "qk_pos_emb_head_dim: 7", "qk_pos_emb_head_dim must be even (RoPE rotates channel pairs)"),
    (64, "hybrid_layer_pattern: 'M*M'", "multi_latent_attention: hybrid_layer_pattern (MLA is for GPT models here)"),
    (64, "qk_layernorm: true", "multi_latent_attention: qk_layernorm without q_lora_rank (megatron-core 0.19 then "
                               "fuses a query norm into linear_q_proj, with Transformer Engine only, and 0.18 has "
                               "none; set q_lora_rank)"),
])
def test_bad_mla_model_fields_are_refused_in_one_line(block, model, message):
    with pytest.raises(CaseFileError) as raised:
        parse_case(_MLA % (block, model))
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_mla_sizes_apply_to_mla_models_only_and_the_case_round_trips():
    with pytest.raises(CaseFileError, match="kv_lora_rank, v_head_dim apply to multi-latent attention only; set "
                                            "multi_latent_attention: true or remove them"):
        parse_case("name: m\nrequests: [{prompt: hi}]\nmodel: {kv_lora_rank: 8, v_head_dim: 8}\n")
    case = load_case("mla_tiny")
    assert case.model.features == ["mla"] and load_case("rl_rollouts").model.features == []
    assert (case.model.q_lora_rank, case.model.kv_lora_rank, case.model.qk_head_dim, case.model.qk_pos_emb_head_dim,
            case.model.v_head_dim, case.inference.block_size_tokens) == (32, 32, 16, 8, 16, 64)
    assert parse_case(dump_case(case)) == case
    planned = plan_requests(case, TOKENIZER)
    assert [len(p.prompt_tokens) for p in planned] == [147, 71, 128, 144]
    assert all(p.prompt_tokens[:128] == planned[2].prompt_tokens for p in planned if p.request_id != 1)


def test_mla_rope_type_defaults_to_yarn_as_megatron_core_and_applies_to_mla_only():
    """``rope_type`` and the YaRN parameters: megatron-core's ``MLATransformerConfig`` defaults, MLA
    models only; the shipped rope MLA cases say so."""
    with pytest.raises(CaseFileError, match="beta_fast, rope_type apply to multi-latent attention only"):
        parse_case("name: m\nrequests: [{prompt: hi}]\nmodel: {rope_type: rope, beta_fast: 8}\n")
    model = parse_case(_MLA % (64, "kv_lora_rank: 32")).model
    assert (model.rope_type, model.rotary_scaling_factor, model.original_max_position_embeddings, model.beta_fast,
            model.beta_slow, model.mscale, model.mscale_all_dim) == ("yarn", 40, 4096, 32, 1, 1.0, 0.0)
    assert [load_case(n).model.rope_type for n in ("mla_tiny", "moe_mla_mtp_tiny", "mla_yarn_tiny")] == [
        "rope", "rope", "yarn"]
    assert load_case("mla_yarn_tiny").model.mscale_all_dim == 1.0
    with pytest.raises(CaseFileError, match="rope_type"):
        parse_case(_MLA % (64, "rope_type: ntk"))
    case = load_case("mla_yarn_tiny")
    assert parse_case(dump_case(case)) == case


def test_speculative_case_without_a_model_section_is_checked_against_the_model_it_runs():
    """A case without ``model`` may take its model from a checkpoint's args (``ab --load``): its
    drafts are checked against that model when the run starts, not when the file loads."""
    from megatron_ext.harness.speculative import SpeculativeDecodingError, check_supported

    case = parse_case("name: x\ninference: {num_speculative_tokens: 1}\nrequests: [{prompt: hi}]\n", "case.yaml")
    with pytest.raises(SpeculativeDecodingError, match="case 'x': inference.num_speculative_tokens=1 needs MTP "
                                                       "layers to draft them"):
        check_supported(case)
