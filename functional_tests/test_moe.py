"""Mixture of experts with routing replay (``moe_tiny``) through ``ab``: routing audited and equal.

Patched, every request's routing has one row per token but the last, is the same with caching on
and off, and (0.18+: megatron-core stores routing per KV block) the routing-replay audit checked
every position of every request in every run. Without the release's routing fix the verdict
names it: R1 on 0.17 (a prefix-cached request's matched prefix left out), R2 on 0.18 / 0.19 (a
finished request whose block was handed out again in the step gets no routing).
"""

from __future__ import annotations

import json

import pytest
import torch

import megatron_ext
from megatron_ext import cli
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness.ab import run_ab
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.checkpoint import read_common_state

#: What the verdict says with the release's routing fix left out (MEGATRON_EXT_SKIP).
UNFIXED = {
    "0.17": ("routing-per-block", [
        "fault R1 (routing-per-block): run ref_zero: 4 requests whose routing has fewer rows than "
        "tokens but the last: r0.s1, r0.s2, r1.s0, r2.s0",
        "fault R1 (routing-per-block): run lru: 5 requests whose routing has fewer rows than "
        "tokens but the last: r0.s1, r0.s2, r1.s0, r2.s0, r3.s0"]),
    "0.18": ("routing-finished-blocks", [
        "fault R2 (routing-finished-blocks): 2 finished MoE requests given no routing; first: step 5: "
        "request 0: megatron-core reconstructed no routing from blocks [13, 14, 12] (37 tokens expected)"]),
}
UNFIXED["0.19"] = UNFIXED["0.18"]


@pytest.mark.slow
def test_moe_routing_is_whole_equal_and_audited(mcore_series):
    result = run_ab(load_case("moe_tiny"), patched=True)
    assert result.failures() == []
    assert result.as_json()["model_features"] == ["moe", "routing_replay"]
    assert all(d.routing_equal for p in result.policies for d in p.diffs)
    for run in result.runs:
        rows = [len(o.routing) for o in run.outputs.values()]
        assert rows == [o.prompt_length + len(o.tokens) - 1 for o in run.outputs.values()]
        audited = run.audit.routing_tokens_checked
        assert audited == (0 if mcore_series == "0.17" else sum(rows))  # 0.17 has no per-block routing
        # the pool; 0.17: the store of fault R1's patch, written only with caching on
        assert run.audit.block_routing_max_entries == (0 if mcore_series == "0.17" and not run.prefix_caching else 15)
    assert sum(p.run.counters.blocks_matched for p in result.policies) == 18


@pytest.mark.slow
@pytest.mark.every_tree
def test_moe_verdict_names_the_routing_fault_of_this_release(monkeypatch, mcore_series):
    fix, expected = UNFIXED[mcore_series]
    megatron_ext.revert()
    monkeypatch.setenv("MEGATRON_EXT_SKIP", fix)
    try:
        result = run_ab(load_case("moe_tiny"), patched=True)
    finally:
        megatron_ext.revert()
    assert next(p for p in result.patches if p["patch"] == fix)["state"] == "not applied"
    failures = result.failures()
    assert [f for f in failures if f.startswith("fault R")] == expected
    assert result.exit_code() == 1


NO_MODEL_CASE = """name: moe-from-checkpoint
inference: {block_size_tokens: 16, buffer_size_gb: 0.000123, max_requests: 8, max_tokens: 256, max_sequence_length: 256}
requests:
  - {prompt: "System: route every token well!!", samples: 3, num_tokens_to_generate: 6}
  - {prefix: "System: route every token well!!", prompt: " Q: which expert wins?", arrival_step: 2,
     num_tokens_to_generate: 4}
"""


@pytest.mark.slow
def test_moe_checkpoint_round_trip_builds_the_moe_model_from_its_args(tmp_path, monkeypatch):
    """``save-checkpoint --case moe_tiny`` writes Megatron-LM's MoE args; ``ab --load`` with a case
    without a model section builds the same MoE model from them and loads its experts bit for bit."""
    import megatron_ext.harness.ab as ab_module
    from megatron_ext.harness.engine import build_model

    built = []
    monkeypatch.setattr(ab_module, "build_model", lambda case: built.append(build_model(case)) or built[-1])
    ckpt, case, out = tmp_path / "ckpt", tmp_path / "no_model.yaml", tmp_path / "ab.json"
    assert cli.main(["save-checkpoint", str(ckpt), "--case", "moe_tiny"]) == 0
    args = read_common_state(ckpt / "iter_0000001")["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.moe_enable_routing_replay) == \
        (4, 2, 64, True)
    case.write_text(NO_MODEL_CASE)
    assert cli.main(["ab", "--case", str(case), "--load", str(ckpt), "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["verdict"] == "pass" and result["model_features"] == ["moe", "routing_replay"]
    assert result["weights"]["model"] == "checkpoint args"
    (model,) = built
    assert (model.config.num_moe_experts, model.config.moe_router_topk, model.config.moe_ffn_hidden_size) == (4, 2, 64)
    with cpu_backend():
        saved = build_model(load_case("moe_tiny"))  # same seed: the weights save-checkpoint wrote
    loaded = dict(model.named_parameters())
    experts = [name for name, _ in saved.named_parameters() if ".experts." in name]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2) weights; no biases (add_bias_linear: false)
    for name, param in saved.named_parameters():
        assert torch.equal(loaded[name], param), name


def moe_rounds_case():
    """``rl_weight_update`` (3 rounds, 2 train steps, suspend/resume, shared system prompt) on
    ``moe_tiny``'s MoE model (no biases, as MoE models train)."""
    return load_case("rl_weight_update").model_copy(update={"name": "moe_rounds", "model": load_case("moe_tiny").model})


@pytest.mark.slow
def test_moe_rounds_with_train_steps_replay_fresh_routing_and_the_trainer_replays_it(mcore_series):
    """Across two training steps with the prefix cache flushed (fault 8's fix) no stale routing is
    replayed (audited where megatron-core stores routing per block: 0.18+), and the trainer forward
    replays the engine's routing: log-probs bit-identical."""
    result = run_ab(moe_rounds_case(), patched=True, trainer_logprobs="matched")
    report = result.as_json()
    assert (report["failures"], report["bit_identical"], report["num_requests"]) == ([], True, 13)
    assert (report["routing_replay_violations"], report["stale_hits"], report["routing_tokens_checked"] > 0) == (
        0, 0, mcore_series != "0.17")
    assert [len(run.updates) for run in result.runs] == [2, 2, 2]
    trainer = report["trainer_logprobs"]
    assert {name: (run["tokens"], run["bit_identical_tokens"], run["left_out_tokens"], run["routing_replayed"])
            for name, run in trainer.items()} == {name: (72, 72, 24, True) for name in (
                "A: caching off", "B: caching on, ref_zero", "B: caching on, lru")}


def test_moe_biases_megatron_core_cannot_run_are_refused_in_one_line():
    from megatron_ext.harness.ab import check_moe_biases
    from megatron_ext.harness.cases import CaseFileError
    from megatron_ext.harness.weight_updates import WeightUpdateError

    rounds = moe_rounds_case()
    biased = rounds.model.model_copy(update={"add_bias_linear": True})
    with pytest.raises(WeightUpdateError) as error:
        run_ab(rounds.model_copy(update={"model": biased}), patched=True)
    assert str(error.value) == (
        "case 'moe_rounds': weight_updates kind train_step on a mixture-of-experts model with add_bias_linear: "
        "megatron-core's expert MLP cannot be trained with biases (autograd refuses its in-place bias add); set "
        "model.add_bias_linear: false or use kind perturb")
    tiny = load_case("moe_tiny")
    tiny = tiny.model_copy(update={"model": tiny.model.model_copy(update={"add_bias_linear": True})})
    check_moe_biases(tiny, 1)  # one rank, no training step: megatron-core runs expert biases
    with pytest.raises(CaseFileError) as error:
        check_moe_biases(tiny, 2)
    assert str(error.value) == (
        "case 'moe_tiny': a mixture-of-experts model with add_bias_linear under tensor parallelism (TP=2): "
        "megatron-core supports expert biases with expert tensor parallel size 1 only; set "
        "model.add_bias_linear: false")
    check_moe_biases(load_case("moe_tiny"), 2)  # moe_tiny has no biases
