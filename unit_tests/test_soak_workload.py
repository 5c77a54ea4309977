"""The generated soak workload: exact size, reproducible, the shapes it promises, and it fits."""

from __future__ import annotations

import pytest

from megatron_ext.harness.cases import CaseFileError, dump_case, load_case, plan_requests
from megatron_ext.harness.soak import MAX_PROMPT_TOKENS, SOAK_INFERENCE, soak_case
from megatron_ext.harness.tokenizer import default_tokenizer

TOKENIZER = default_tokenizer()


@pytest.mark.parametrize("requests", [1, 2, 7, 150, 2000])
def test_exactly_the_requested_number_of_requests(requests):
    planned = plan_requests(soak_case(requests, seed=5), TOKENIZER)  # also: every request fits
    assert len(planned) == requests
    assert sorted(p.request_id for p in planned) == list(range(requests))


def test_same_seed_same_case_other_seed_other_case():
    assert soak_case(150, seed=3) == soak_case(150, seed=3)
    assert soak_case(150, seed=3).requests != soak_case(150, seed=4).requests


def test_shapes_lengths_and_arrivals():
    case = soak_case(2000, seed=0)
    planned = plan_requests(case, TOKENIZER)
    assert case.inference.enable_chunked_prefill and case.inference == SOAK_INFERENCE
    assert case.prefix_caching_eviction_policies == ["ref_zero", "lru"]
    rollouts = [s for s in case.requests if s.samples > 1]
    conversations = [s for s in case.requests if s.conversation and len(s.conversation) >= 3]
    system_prompts = {s.prefix for s in case.requests if s.prefix}
    assert len(rollouts) > 100 and len(conversations) > 100 and len(system_prompts) == 3
    lengths = [len(p.prompt_tokens) for p in planned]
    assert min(lengths) >= 1 and max(lengths) <= MAX_PROMPT_TOKENS
    assert sum(n > case.inference.max_tokens for n in lengths) > 50  # prefilled in several chunks
    assert {n % 16 == 0 for n in lengths} == {True, False}  # on and off block boundaries
    arrivals = [p.arrival_step for p in planned]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 1000 and len(set(arrivals)) > 500
    # the largest request fits the pool, so none is refused for size
    block = case.inference.block_size_tokens
    assert max(-(-(len(p.prompt_tokens) + p.num_tokens_to_generate) // block) for p in planned) <= 48


def test_unchunked_variant_fits_every_prompt_in_one_step():
    case = soak_case(300, seed=0, chunked_prefill=False)
    assert not case.inference.enable_chunked_prefill
    assert max(len(p.prompt_tokens) for p in plan_requests(case, TOKENIZER)) <= case.inference.max_tokens


def test_unchunked_mla_is_the_mla_workload_unrenamed():
    # the MLA soak never chunks prefill, so --no-chunked-prefill changes nothing and the name says so
    assert soak_case(40, seed=0, model="mla", chunked_prefill=False) == soak_case(40, seed=0, model="mla")
    assert soak_case(40, seed=0, chunked_prefill=False).name == "soak-40-seed0-unchunked"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="--requests must be >= 1, got 0"):
        soak_case(0)
    with pytest.raises(CaseFileError, match="soak: field 'prefix_caching_eviction_policies.0'"):
        soak_case(10, policies=["fifo"])


def test_dumped_case_file_loads_as_the_same_case(tmp_path):
    case = soak_case(60, seed=2)
    path = tmp_path / "soak.yaml"
    path.write_text(dump_case(case))
    assert load_case(str(path)) == case


def test_hybrid_variant_is_a_small_hybrid_model_with_short_prompts():
    from megatron_ext.harness.soak import SOAK_HYBRID_INFERENCE, SOAK_HYBRID_MODEL

    case = soak_case(2000, seed=0, model="hybrid")
    assert case.name == "soak-2000-seed0-hybrid"
    assert case.model == SOAK_HYBRID_MODEL and case.model.is_hybrid
    assert case.model.mamba_chunk_size == case.inference.block_size_tokens == 16
    assert case.inference == SOAK_HYBRID_INFERENCE and case.inference.prefix_caching_mamba_gb == 0.001
    planned = plan_requests(case, TOKENIZER)
    assert len(planned) == 2000
    lengths = [len(p.prompt_tokens) for p in planned]
    # at most 64 tokens, conversations up to 71 (each message keeps its role label)
    assert max(lengths) == 71 and sum(n > 64 for n in lengths) == 55
    assert {s.prefix for s in case.requests if s.prefix} == {
        "System: You are a careful assist", "System: You are a patient tutor.", "System: Reply as a terse code re"}
    assert max(p.num_tokens_to_generate for p in planned) == 3
    assert max(p.arrival_step for p in planned) == 575
    assert soak_case(12, seed=0, model="hybrid").requests == soak_case(12, seed=0, model="hybrid").requests
    assert soak_case(100, seed=0) == soak_case(100, seed=0, model="gpt")  # the GPT soak is unchanged


def test_moe_variant_is_the_soak_workload_on_a_routing_replay_model():
    case = soak_case(300, seed=3, model="moe")
    plain = soak_case(300, seed=3)
    assert case.name == "soak-300-seed3-moe" and case.requests == plain.requests
    assert case.inference == plain.inference == SOAK_INFERENCE
    assert (case.model.num_experts, case.model.moe_router_topk, case.model.moe_ffn_hidden_size,
            case.model.params_dtype, case.model.hidden_size) == (4, 2, 64, "fp32", 64)
    assert "routing_replay" in case.model.features and "moe" in case.model.features
    with pytest.raises(ValueError, match="model 'moe-mla' is none of gpt, hybrid, moe, mla, mtp"):
        soak_case(10, model="moe-mla")


def test_mla_variant_admits_every_request_at_its_arrival_step():
    from megatron_ext.harness.soak import SOAK_MLA_MODEL

    case = soak_case(40, seed=0, model="mla")
    assert case.name == "soak-40-seed0-mla" and case.model == SOAK_MLA_MODEL
    assert (case.inference.block_size_tokens, case.inference.enable_chunked_prefill) == (64, False)
    planned = plan_requests(case, TOKENIZER)
    assert len(planned) == 40 and max(len(p.prompt_tokens) for p in planned) == 111  # at most 112
    # rollout samples arrive one per step; 1 in 4 rollout prompts is a whole number of blocks
    rollouts = [s for s in case.requests if not s.prefix and not s.conversation]
    assert all(s.samples == 1 for s in rollouts)
    assert sorted({len(s.prompt) for s in rollouts if len(s.prompt) % 64 == 0}) == [64]
    # sized by fit_without_waiting: 16 requests live at most, 27 blocks of 64 latent tokens (bf16,
    # 2 layers x 40 channels) + the dummy block
    assert (case.inference.max_requests, case.inference.max_tokens) == (16, 1024)
    assert case.inference.buffer_size_gb * 1024**3 == 28 * 2 * 2 * 64 * 40


def test_mla_variant_with_yarn_is_the_same_workload_with_megatrons_mla_rope():
    """``soak --mla --rope-type yarn``: ``mla_tiny``'s model with rope_type yarn (megatron-core's YaRN
    defaults), the same requests and engine; --rope-type with another model is refused."""
    from megatron_ext.harness.cases import CaseFileError
    from megatron_ext.harness.soak import SOAK_MLA_MODEL

    case, plain = soak_case(40, seed=0, model="mla", rope_type="yarn"), soak_case(40, seed=0, model="mla")
    assert case.name == "soak-40-seed0-mla-yarn" and case.description.endswith(
        "latent KV cache in blocks of 64 tokens, RoPE type yarn.")
    assert case.model == SOAK_MLA_MODEL.model_copy(update={"rope_type": "yarn"})
    assert (case.model.rope_type, case.model.rotary_scaling_factor, case.model.mscale_all_dim) == ("yarn", 40, 0)
    assert (case.requests, case.inference) == (plain.requests, plain.inference)
    assert SOAK_MLA_MODEL.rope_type == "rope"
    with pytest.raises(CaseFileError, match="soak: --rope-type yarn applies to --mla only, and is rope or yarn"):
        soak_case(10, model="moe", rope_type="yarn")


def test_mtp_variant_is_the_soak_workload_with_two_drafts_per_step():
    from megatron_ext.harness.soak import MTP_MAX_GENERATED_TOKENS, SOAK_MTP_INFERENCE, SOAK_MTP_MODEL

    case = soak_case(40, seed=0, model="mtp")
    assert case.name == "soak-40-seed0-mtp" and (case.model, case.inference) == (SOAK_MTP_MODEL, SOAK_MTP_INFERENCE)
    assert case.inference.num_speculative_tokens == 2 and case.model.features == ["mtp"]
    assert [s.prompt for s in case.requests] == [s.prompt for s in soak_case(40, seed=0).requests]
    assert max(s.num_tokens_to_generate for s in case.requests) <= MTP_MAX_GENERATED_TOKENS == 16
