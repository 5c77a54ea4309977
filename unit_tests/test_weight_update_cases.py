"""The ``weight_updates:`` section of a case and each request's ``round``: planning and every refusal.

Each refusal is one line naming the field and the fix (``parse_case`` raises CaseFileError; the
CLI prints it and exits 2 before building anything).
"""

from __future__ import annotations

import pytest

from megatron_ext import cli
from megatron_ext.harness import ab
from megatron_ext.harness.cases import CaseFileError, dump_case, load_case, parse_case, plan_requests
from megatron_ext.harness.soak import soak_case, with_weight_updates
from megatron_ext.harness.tokenizer import default_tokenizer

GOOD = """
name: rounds
weight_updates: {kind: perturb, update_at_steps: [10, 20], perturb_scale: 0.5, seed: 7}
requests:
  - {prompt: "abc", samples: 2, arrival_step: 3}
  - {prompt: "abcd", round: 1, arrival_step: 2}
  - {prompt: "abcde", round: 2}
"""


def refusal(text: str) -> str:
    with pytest.raises(CaseFileError) as caught:
        parse_case(text, "case.yaml")
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_rounds_make_arrival_steps_absolute():
    case = parse_case(GOOD)
    assert case.weight_updates.rounds == 3
    planned = plan_requests(case, default_tokenizer())
    assert [(p.label, p.round, p.arrival_step) for p in planned] == [
        ("r0.s0", 0, 3), ("r0.s1", 0, 3), ("r1.s0", 1, 12), ("r2.s0", 2, 20)]


def test_defaults_of_a_weight_update():
    spec = parse_case(GOOD.replace("perturb_scale: 0.5, seed: 7", "suspend_resume: true")).weight_updates
    assert (spec.suspend_resume, spec.kv_cache_management_mode, spec.perturb_scale, spec.seed) == (True, "persist", 0.01, 0)


def test_shipped_rl_weight_update_case():
    case = load_case("rl_weight_update")
    spec = case.weight_updates
    assert (spec.kind, spec.update_at_steps, spec.suspend_resume, spec.kv_cache_management_mode) == (
        "train_step", [16, 34], True, "persist")
    assert case.prefix_caching_eviction_policies == ["ref_zero", "lru"]
    assert case.inference.enable_chunked_prefill
    planned = plan_requests(case, default_tokenizer())
    assert [(p.label, p.round, p.arrival_step, p.num_tokens_to_generate) for p in planned] == [
        ("r0.s0", 0, 0, 24), *((f"r1.s{i}", 0, 1, 6) for i in range(4)),
        *((f"r2.s{i}", 1, 16, 6) for i in range(4)), ("r3.s0", 2, 34, 6), ("r3.s1", 2, 34, 6),
        ("r4.s0", 2, 35, 6), ("r4.s1", 2, 35, 6)]
    prefix = default_tokenizer().tokenize("System: answer in one short sentence then stop.\n")
    assert len(prefix) == 48 and all(p.prompt_tokens[:48] == prefix for p in planned)


@pytest.mark.parametrize("old, new, message", [
    ("kind: perturb", "kind: refit",
     "field 'weight_updates.kind': Input should be 'train_step', 'perturb' or 'checkpoint'"),
    ("update_at_steps: [10, 20]", "update_at_steps: [20, 10]",
     "update_at_steps [20, 10] must be engine steps >= 1 in increasing order"),
    ("perturb_scale: 0.5", "perturb_scale: 0", "field 'weight_updates.perturb_scale': Input should be greater than 0"),
    ("seed: 7", "sed: 7", "field 'weight_updates.sed': Extra inputs are not permitted"),
])
def test_bad_weight_update_fields_are_named(old, new, message):
    assert message in refusal(GOOD.replace(old, new))


def test_rounds_without_the_weight_updates_section_are_refused():
    text = GOOD.replace("weight_updates: {kind: perturb, update_at_steps: [10, 20], perturb_scale: 0.5, seed: 7}\n", "")
    assert "requests.1.round is 1 but the case has 1 round(s) (0 to 0); add a weight_updates section" in refusal(text)


@pytest.mark.parametrize("section, message", [
    ("{kind: perturb, update_at_steps: [10, 20], learning_rate: 0.1}",
     "'learning_rate' applies to kind train_step only, this update is kind perturb; remove it"),
    ("{kind: train_step, update_at_steps: [10, 20], perturb_scale: 0.1}",
     "'perturb_scale' applies to kind perturb only, this update is kind train_step; remove it"),
    ("{kind: perturb, update_at_steps: [10, 20], checkpoints: [/tmp/c]}",
     "'checkpoints' applies to kind checkpoint only, this update is kind perturb; remove it"),
    ("{kind: train_step, update_at_steps: [10, 20], optimizer: adam, perturb_scale: 1}",
     "'perturb_scale' applies to kind perturb only"),
    ("{kind: perturb, update_at_steps: [10, 20], kv_cache_management_mode: offload}",
     "'kv_cache_management_mode' is the engine's mode across suspend()/resume(); set suspend_resume: true or remove it"),
    ("{kind: perturb, update_at_steps: [10, 20], suspend_resume: true, kv_cache_management_mode: unified}",
     "kv_cache_management_mode 'unified' is not one of megatron-core's modes that run here: persist, offload, recompute"),
    ("{kind: checkpoint, update_at_steps: [10, 20], checkpoints: [/a, /b, /c]}",
     "3 checkpoints for 2 updates; give one (loaded at every update) or one per update"),
    ("{kind: perturb, update_at_steps: [0, 20]}", "update_at_steps [0, 20] must be engine steps >= 1"),
    ("{kind: perturb, update_at_steps: []}", "field 'weight_updates.update_at_steps': List should have at least 1 item"),
    ("{kind: train_step, update_at_steps: [10, 20], optimizer: lbfgs}", "field 'weight_updates.optimizer': Input should be 'sgd' or 'adam'"),
])
def test_fields_that_do_not_fit_the_update_are_refused(section, message):
    text = GOOD.replace("{kind: perturb, update_at_steps: [10, 20], perturb_scale: 0.5, seed: 7}", section)
    assert message in refusal(text)


@pytest.mark.parametrize("requests, message", [
    ('[{prompt: "a"}, {prompt: "b", round: 3}]',
     "requests.1.round is 3 but the case has 3 round(s) (0 to 2); add an update to "
     "weight_updates.update_at_steps or lower 'round'"),
    ('[{prompt: "a", arrival_step: 10}, {prompt: "b", round: 2}]',
     "requests.0 (round 0) arrives at engine step 10, not before the update at step 10 that ends its round; "
     "lower its arrival_step (it counts from the round's start) or give it round 1"),
    ('[{prompt: "a"}, {prompt: "b", round: 1, arrival_step: 11}, {prompt: "c", round: 2}]',
     "requests.1 (round 1) arrives at engine step 21, not before the update at step 20"),
    ('[{conversation: ["a", "b", "c"], turn_interval: 6, arrival_step: 5}, {prompt: "c", round: 2}]',
     "requests.0 (round 0) arrives at engine step 11, not before the update at step 10"),
    ('[{prompt: "a"}, {prompt: "b", round: 1}]',
     "no request is in the last round (2), so the update at step 20 may come after every request finished; "
     "give a request 'round: 2' or drop that update"),
    ('[{prompt: "a", round: -1}]', "field 'requests.0.round': Input should be greater than or equal to 0"),
])
def test_requests_must_fit_their_rounds(requests, message):
    text = "name: r\nweight_updates: {kind: perturb, update_at_steps: [10, 20]}\nrequests: " + requests + "\n"
    assert message in refusal(text)


def test_a_round_without_weight_updates_is_refused():
    assert refusal('name: r\nrequests: [{prompt: "a", round: 1}]\n') == (
        "case.yaml: field '<top>': Value error, requests.0.round is 1 but the case has 1 round(s) (0 to 0); "
        "add a weight_updates section")


def test_cli_refuses_a_bad_weight_update_in_one_line(tmp_path, monkeypatch, capsys):
    for name in ("build_model", "build_engine", "apply", "run_ab"):
        monkeypatch.setattr(ab, name, lambda *a, **k: pytest.fail("ran something before refusing the input"))
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace("perturb_scale: 0.5", "learning_rate: 0.5"))
    assert cli.main(["ab", "--case", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron-ext: error: {path}: field 'weight_updates': Value error, 'learning_rate' applies to "
                   "kind train_step only, this update is kind perturb; remove it"]


def test_update_from_needs_a_checkpoint_update(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ab, "build_model", lambda *a, **k: pytest.fail("built a model before refusing"))
    monkeypatch.setattr(ab, "apply", lambda *a, **k: pytest.fail("patched before refusing"))
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert cli.main(["ab", "--update-from", str(checkpoint), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megatron-ext: error: --update-from loads a checkpoint at each weight update, but case "
                   "'rl_rollouts' has no weight_updates section; use a case with weight_updates: "
                   "{kind: checkpoint, ...}"]


def test_soak_update_every_splits_the_same_workload_into_rounds():
    plain, rounds = soak_case(60, seed=0), soak_case(60, seed=0, update_every=15)
    spec = rounds.weight_updates
    assert spec.kind == "perturb" and spec.update_at_steps == [15 * k for k in range(1, len(spec.update_at_steps) + 1)]
    a, b = (plan_requests(c, default_tokenizer()) for c in (plain, rounds))
    assert sorted((p.arrival_step, p.prompt_tokens) for p in a) == sorted((p.arrival_step, p.prompt_tokens) for p in b)
    assert all(p.arrival_step // 15 == p.round for p in b)
    assert rounds.name == "soak-60-seed0-update-every-15"
    assert rounds.expectations.update_timing == "exclude" and plain.expectations.update_timing == "fail"
    assert parse_case(dump_case(rounds)) == rounds  # soak --dump-case reruns with ab --case
    with pytest.raises(ValueError, match="--update-every must be >= 1, got 0"):
        with_weight_updates(plain.requests, 0, 0)


def test_update_from_a_missing_directory_names_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ab, "build_model", lambda *a, **k: pytest.fail("built a model before refusing"))
    case = tmp_path / "ck.yaml"
    case.write_text('name: ck\nweight_updates: {kind: checkpoint, update_at_steps: [5]}\n'
                    'requests: [{prompt: "a"}, {prompt: "b", round: 1}]\n')
    assert cli.main(["ab", "--case", str(case), "--update-from", str(tmp_path / "nope"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"megatron-ext: error: --update-from {tmp_path / 'nope'}: no such directory")
