"""The shipped multi-latent attention case (``mla_tiny``) through megatron-core's own engine on the CPU.

0.18 and 0.19 run it: caching on vs off bit-identical, every audit clean, the latent writes of
tokens recomputed inside matched blocks sent to the dummy block (fix 2 on the latent path), and
without ``matched-block-writes`` the KV-write audit names the one matched block written. 0.17
cannot run MLA with prefix caching (:mod:`megatron_ext.harness.mla`): there ``ab`` refuses by name
and exits 2 before building anything.
"""

from __future__ import annotations

import math

import pytest
import torch

import megatron_ext
from functional_tests.conftest import SERIES
from megatron_ext.patches import ALL_PATCHES
from megatron_ext import cli, mcore
from megatron_ext.harness import ab
from megatron_ext.harness.ab import run_ab
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness import engine
from megatron_ext.harness.cases import Case, load_case, plan_requests
from megatron_ext.harness.engine import build_engine, build_model, ensure_model_parallel
from megatron_ext.harness.step_loop import RunRecord, drive
from megatron_ext.harness.tokenizer import default_tokenizer
from megatron_ext.harness.mla import (MLA_SERIES, STEP_KIND_NOTE, MLAUnsupportedError, check_mla_run,
                                      mla_config_fields)
from unit_tests.conftest import one_error_line

RUNS_MLA = SERIES in MLA_SERIES
REFUSAL = (f"case 'mla_tiny': multi-latent attention with prefix caching does not run on megatron-core "
           f"{mcore.installed_version()}: its flash_decode_and_prefill sends a mixed step whose queries all have "
           "one token to the FlashMLA decode kernel with unabsorbed queries; use megatron-core 0.18 or 0.19")
#: greedy tokens of the four requests, the same with caching off and on (bf16, seed 1234)
TOKENS = [[63, 220, 121, 63, 220, 121], [206, 206, 206, 126, 59, 61], [220, 121, 1, 118, 117, 126],
          [63, 220, 121, 1, 118, 117]]
#: the exact prefix (request 2) recomputes the second matched block: 64 tokens x 2 layers
REDIRECTED = 128


def _run(monkeypatch, skip: str | None):
    megatron_ext.revert()
    if skip:
        monkeypatch.setenv("MEGATRON_EXT_SKIP", skip)
    try:
        return run_ab(load_case("mla_tiny"), patched=True)
    finally:
        megatron_ext.revert()


@pytest.mark.slow
def test_mla_tiny_is_bit_identical_with_latent_writes_redirected(monkeypatch):
    if not RUNS_MLA:
        with pytest.raises(MLAUnsupportedError) as error:
            _run(monkeypatch, None)
        assert str(error.value) == REFUSAL
        return
    result = _run(monkeypatch, None)
    assert result.invariance[0], result.invariance[1]
    assert result.failures() == [] and result.bit_identical and result.exit_code() == 0
    assert result.as_json()["model_features"] == ["mla"]
    assert [o.tokens for o in result.baseline.outputs.values()] == TOKENS
    for policy in result.policies:
        audit, counters = policy.run.audit, policy.run.counters
        assert (policy.run.eviction_policy, counters.blocks_matched, counters.prefill_tokens_skipped) in (
            ("ref_zero", 4, 192), ("lru", 4, 192))
        assert (audit.kv_write_violations, audit.kv_writes_checked, audit.kv_writes_redirected) == (0, 636, REDIRECTED)
        assert (audit.refcount_violations, audit.lru_violations, audit.stale_hits) == (0, 0, 0)
        assert [o.tokens for o in policy.run.outputs.values()] == TOKENS


#: ``mla_yarn_tiny``'s greedy tokens, the same with caching off and on (bf16, seed 1234; YaRN RoPE)
YARN_TOKENS = [[63, 220, 121, 1, 118, 117], [206, 13, 126, 126, 126, 169], [220, 121, 1, 118, 117, 126],
               [63, 220, 121, 1, 118, 117]]


@pytest.mark.slow
def test_mla_yarn_tiny_builds_megatron_cores_yarn_and_is_bit_identical_with_prefix_hits():
    """MLA as Megatron configures it (``rope_type`` absent: yarn): megatron-core's
    ``YarnRotaryEmbedding`` on CPU tensors under the CPU backend, caching on vs off bit-identical
    with 4 blocks matched per policy."""
    case = load_case("mla_yarn_tiny")
    with cpu_backend():
        ensure_model_parallel()
        model = build_model(case)
    yarn = mcore.import_module("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    config, attention = model.config, model.decoder.layers[0].self_attention
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings,
            config.beta_fast, config.beta_slow, config.mscale, config.mscale_all_dim) == ("yarn", 40, 4096, 32, 1, 1, 1)
    assert type(attention.rotary_pos_emb) is yarn.YarnRotaryEmbedding
    assert attention.rotary_pos_emb.cos_cached.device.type == "cpu"
    assert attention.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(16 + 8), rel=1e-12)
    if not RUNS_MLA:
        with pytest.raises(MLAUnsupportedError):
            run_ab(case, patched=True)
        return
    megatron_ext.revert()
    try:
        result = run_ab(case, patched=True)
    finally:
        megatron_ext.revert()
    assert result.failures() == [] and result.bit_identical and result.exit_code() == 0
    assert result.as_json()["model_features"] == ["mla"]
    assert [o.tokens for o in result.baseline.outputs.values()] == YARN_TOKENS
    for policy in result.policies:
        counters, audit = policy.run.counters, policy.run.audit
        assert (counters.blocks_matched, counters.prefill_tokens_skipped) == (4, 192)
        assert (audit.kv_write_violations, audit.refcount_violations, audit.lru_violations) == (0, 0, 0)
        assert [o.tokens for o in policy.run.outputs.values()] == YARN_TOKENS


@pytest.mark.slow
def test_mla_tiny_without_matched_block_writes_writes_latents_into_a_matched_block(monkeypatch):
    if not RUNS_MLA:
        with pytest.raises(MLAUnsupportedError) as error:
            _run(monkeypatch, "matched-block-writes")
        assert str(error.value) == REFUSAL
        return
    result = _run(monkeypatch, "matched-block-writes")
    assert next(p for p in result.patches if p["patch"] == "matched-block-writes")["state"] == "not applied"
    assert result.failures() == ["fault 2 (matched-block-writes): 2 KV writes into blocks obtained by a hash match"]
    assert result.exit_code() == 1
    for policy in result.policies:
        audit = policy.run.audit
        assert (audit.kv_write_violations, audit.kv_writes_redirected) == (1, 0)
        assert audit.examples == {"kv_write": ["step 2: request 2 wrote KV into block 49, obtained by hash match"]}


def test_mla_options_it_cannot_run_exit_2_before_building(monkeypatch, capsys):
    monkeypatch.setattr(ab, "build_model", lambda *a, **k: pytest.fail("built a model for a refused MLA run"))
    assert cli.main(["ab", "--case", "mla_tiny", "--no-progress", "--trainer-logprobs"]) == 2
    assert one_error_line(capsys) == "megatron-ext: error: " + (REFUSAL if not RUNS_MLA else (
        "case 'mla_tiny': multi-latent attention models run single-rank, and with cached latents megatron-core runs "
        "them only under the dynamic engine (a forward without its inference context, training or the trainer's, "
        "asserts after the first inference forward); drop --trainer-logprobs"))


def test_check_mla_run_names_every_option_it_cannot_run():
    case = load_case("mla_tiny")
    updates = load_case("rl_weight_update").weight_updates
    with_updates = case.model_copy(update={"weight_updates": updates})
    with pytest.raises(MLAUnsupportedError) as error:
        check_mla_run(with_updates, "0.19.2", 2, 1, trainer_logprobs="matched")
    assert str(error.value) == (
        "case 'mla_tiny': multi-latent attention models run single-rank, and with cached latents megatron-core runs "
        "them only under the dynamic engine (a forward without its inference context, training or the trainer's, "
        "asserts after the first inference forward); drop tensor/pipeline parallelism (TP=2 PP=1), --trainer-logprobs, "
        "weight_updates kind train_step (use kind perturb)")
    check_mla_run(mla_rounds_case(), "0.19.2")  # perturb updates run (fault M1 checked after each)
    with pytest.raises(MLAUnsupportedError, match="does not run on megatron-core 0.17.1"):
        check_mla_run(case, "0.17.1")
    check_mla_run(case, "0.18.2")  # a plain run on 0.18 / 0.19 passes
    check_mla_run(load_case("rl_rollouts"), "0.17.1")  # a GPT case is never an MLA case


def _greedy_uncached(model, prompt: list[int], count: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from megatron-core's MLA forward without an inference
    context (full sequences, uncompressed keys and values, the reference core attention)."""
    tokens, log_probs = list(prompt), []
    with torch.no_grad():
        for _ in range(count):
            logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None, runtime_gather_output=True)
            row = torch.log_softmax(logits[0, -1].float(), dim=-1)
            tokens.append(int(row.argmax()))
            log_probs.append(float(row[tokens[-1]]))
    return tokens[len(prompt):], log_probs


@pytest.mark.slow
@pytest.mark.parametrize("name, qk_layernorm", [("mla_tiny", True), ("mla_tiny", False), ("mla_yarn_tiny", True)],
                         ids=["qk_layernorm", "no_qk_layernorm", "yarn"])
def test_the_engine_on_the_cpu_stand_ins_matches_the_uncached_mla_forward(monkeypatch, name, qk_layernorm):
    """The latent path end to end (latent cache, uncompressed prefill, FlashMLA stand-in decode with
    absorbed queries, the split's KV norm, the decode flag; ``mla_yarn_tiny``: YaRN's scaled cos/sin
    and softmax scale) against the same weights' uncached forward: same greedy tokens, log-probs
    within 2e-6 (fp32; measured at most 7.2e-7). 0.17 runs the engine with prefix caching off, the
    configuration it can run MLA in."""
    data = load_case(name).model_dump()
    data["model"].update(params_dtype="fp32", qk_layernorm=qk_layernorm)
    case = Case.model_validate(data)
    planned = plan_requests(case, default_tokenizer())
    megatron_ext.revert()
    # megatron-core as released but for fault M2 (without it the first engine step raises)
    monkeypatch.setenv("MEGATRON_EXT_SKIP", ",".join(p.name for p in ALL_PATCHES if p.name != "mla-decode-flag"))
    with cpu_backend():
        ensure_model_parallel()
        with monkeypatch.context() as uncached_config:
            # the same seeded weights without cached latents: megatron-core's uncached MLA forward
            uncached_config.setattr(engine, "mla_config_fields", lambda spec: {
                **mla_config_fields(spec), "cache_mla_latents": False})
            uncached = build_model(case)
        expected = {p.request_id: _greedy_uncached(uncached, p.prompt_tokens, p.num_tokens_to_generate)
                    for p in planned}
        model = build_model(case)
        engine_, context = build_engine(model, case, RUNS_MLA, "ref_zero")
        record = RunRecord(RUNS_MLA, "ref_zero")
        megatron_ext.apply()
        try:
            drive(engine_, context, case, planned, record)
        finally:
            megatron_ext.revert()
    assert record.error is None
    for request_id, (tokens, log_probs) in expected.items():
        output = record.outputs[request_id]
        assert output.tokens == tokens
        assert max(abs(a - b) for a, b in zip(output.log_probs, log_probs)) <= 2e-6


#: ``mla_tiny`` with chunked prefill in 64-token chunks: with caching on, prefills end sooner, so
#: engine steps 5-7 are decode-only in B but still prefill in A.
CHUNKED = {"max_tokens": 64, "enable_chunked_prefill": True}


@pytest.mark.slow
def test_mla_decode_tokens_differ_when_caching_changes_which_steps_prefill(monkeypatch):
    """Not a KV-cache fault: megatron-core's MLA decodes over the latent cache (absorbed) in
    decode-only steps and over uncompressed keys and values in steps that also prefill (0.19).
    0.18 skips no prefix tokens at this chunk size (every chunk recomputes), so its steps match."""
    data = load_case("mla_tiny").model_dump()
    data["inference"].update(CHUNKED)
    case = Case.model_validate(data)
    if not RUNS_MLA:
        with pytest.raises(MLAUnsupportedError):
            run_ab(case, patched=True)
        return
    context_class = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE).DynamicInferenceContext
    steps: list[tuple[bool, bool]] = []
    initialize = context_class.initialize_attention_state

    def recorded(self, *args, **kwargs):
        result = initialize(self, *args, **kwargs)
        steps.append((self.enable_prefix_caching, self.is_decode_only()))
        return result

    monkeypatch.setattr(context_class, "initialize_attention_state", recorded)
    megatron_ext.revert()
    try:
        result = run_ab(case, patched=True)
    finally:
        megatron_ext.revert()
    for policy in result.policies:  # every KV write accounted for, in both releases
        assert (policy.run.audit.kv_write_violations, policy.run.audit.refcount_violations) == (0, 0)
    off = [decode_only for caching, decode_only in steps if not caching]
    on = [decode_only for caching, decode_only in steps if caching][:len(off)]  # the REF_ZERO run
    if SERIES == "0.18":
        assert result.bit_identical and off == on
        assert [p.run.counters.prefill_tokens_skipped for p in result.policies] == [0, 0]
        assert [p.run.audit.kv_writes_redirected for p in result.policies] == [512, 512]
        return
    assert off[:10] == [False] * 8 + [True, True] and on[:10] == [False] * 5 + [True] * 5
    assert [p.run.counters.prefill_tokens_skipped for p in result.policies] == [192, 192]
    for policy in result.policies:
        diffs = {d.request_id: (d.tokens_equal, d.log_probs_equal, d.first_divergent_step) for d in policy.diffs}
        assert diffs == {0: (True, False, 5), 1: (True, False, 5), 2: (True, False, 5), 3: (True, True, None)}
    assert STEP_KIND_NOTE in result.warnings()


def mla_rounds_case() -> Case:
    """``mla_tiny`` in two rounds with a ``perturb`` weight update between them (suspend/resume,
    persist mode): round 1 asks the guide prompts again, so with caching on they would match the
    round-0 blocks unless the update invalidated them, and decode after prefill on new weights."""
    data = load_case("mla_tiny").model_dump()
    guide = dict(data["requests"][0])
    data.update(name="mla_rounds", weight_updates={"kind": "perturb", "update_at_steps": [12], "suspend_resume": True,
                                                   "perturb_scale": 0.02, "seed": 3})
    data["requests"] = [*data["requests"], {**guide, "round": 1},
                        {**guide, "round": 1, "arrival_step": 1, "prompt": "Count the wrens."}]
    data["expectations"]["min_blocks_matched"] = 4
    return Case.model_validate(data)


def _run_rounds(monkeypatch, skip: str | None):
    megatron_ext.revert()
    if skip:
        monkeypatch.setenv("MEGATRON_EXT_SKIP", skip)
    try:
        return run_ab(mla_rounds_case(), patched=True)
    finally:
        megatron_ext.revert()


@pytest.mark.slow
def test_mla_weight_update_reaches_decode_and_prefill_steps(monkeypatch):
    if not RUNS_MLA:
        with pytest.raises(MLAUnsupportedError) as error:
            _run_rounds(monkeypatch, None)
        assert str(error.value) == REFUSAL.replace("'mla_tiny'", "'mla_rounds'")
        return
    result = _run_rounds(monkeypatch, None)
    assert result.failures() == [] and result.bit_identical and result.exit_code() == 0
    for run in result.runs:
        assert [(u.index, u.step, u.mla_stale_layers) for u in run.updates] == [(1, 12, [])]
        assert run.audit.stale_hits == 0
    # every request equals fresh engines on the initial and the updated weights, bit for bit
    assert [(r.compared, r.tokens_compared, r.max_abs_diff) for r in result.post_update_reference.runs] == [
        ({0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}, 36, 0.0)] * 3


@pytest.mark.slow
def test_without_mla_absorbed_weights_the_update_misses_decode_steps(monkeypatch):
    if not RUNS_MLA:
        with pytest.raises(MLAUnsupportedError) as error:
            _run_rounds(monkeypatch, "mla-absorbed-weights")
        assert str(error.value) == REFUSAL.replace("'mla_tiny'", "'mla_rounds'")
        return
    result = _run_rounds(monkeypatch, "mla-absorbed-weights")
    assert next(p for p in result.patches if p["patch"] == "mla-absorbed-weights")["state"] == "not applied"
    runs = ["caching off", "ref_zero", "lru"]
    assert result.failures()[:3] == [
        f"fault M1 (mla-absorbed-weights): run {run}: after weight update 1 (step 12) decode-only steps of MLA layers "
        "1, 2 keep the old KV up-projection (prefill steps have the new one)" for run in runs]
    # the post-update reference sees it too: round 1's decode steps are not the updated weights'
    for reference in result.post_update_reference.runs:
        assert reference.differing == ["r4.s0", "r5.s0"]
        assert (reference.first_difference.version, reference.first_difference.request,
                reference.first_difference.token) == (1, "r4.s0", 2)
    assert result.exit_code() == 1
