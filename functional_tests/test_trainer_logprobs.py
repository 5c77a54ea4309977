"""``ab --trainer-logprobs`` through megatron-core's engine and training forward on the CPU backend.

``matched``: the training forward's log-probs equal the engine's bit for bit in every run (caching
off and on), bf16 and fp32. A deliberately perturbed engine log-prob is found at its request and
token, and fails the verdict. ``megatron``: megatron-core's own training forward (torch's kernels)
is reported, never failed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from functional_tests.conftest import REPO
from megatron_ext import cli
from megatron_ext.harness.ab import run_ab
from megatron_ext.harness.cases import load_case

TINY = Path(__file__).parent / "cases" / "trainer_tiny.yaml"
RUNS = ("A: caching off", "B: caching on, ref_zero", "B: caching on, lru")


def _tiny(dtype: str = "bf16"):
    case = load_case(str(TINY))
    return case.model_copy(update={"model": case.model.model_copy(update={"params_dtype": dtype})})


def test_default_case_matched_is_bit_identical_caching_on_and_off(tmp_path):
    out = tmp_path / "ab.json"
    assert cli.main(["ab", "--trainer-logprobs", "--json", str(out), "--no-progress"]) == 0
    written = json.loads(out.read_text())
    identical = {"tokens": 112, "bit_identical_tokens": 112, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "k3_kl": 0.0}
    assert written["trainer_logprobs"] == {run: identical for run in RUNS}  # 14 requests x 8 tokens per run
    detail = written["trainer_logprobs_detail"]
    assert detail["mode"] == "matched" and list(detail["seconds"]) == list(RUNS)
    for run in RUNS:  # the trainer's values are the engine's, request by request
        engine = {rid: o["log_probs"] for rid, o in
                  (written["baseline"] if run == RUNS[0] else
                   next(p["run"] for p in written["policies"] if run.endswith(p["eviction_policy"])))["outputs"].items()}
        assert {str(r["request_id"]): r["trainer"] for r in detail["requests"][run]} == engine


def test_tiny_case_matched_in_fp32():
    result = run_ab(_tiny("fp32"), trainer_logprobs="matched")
    assert result.failures() == []
    assert {run.label: (run.tokens, run.bit_identical_tokens) for run in result.trainer_logprobs.runs} == {
        "A: caching off": (18, 18), "B: caching on, ref_zero": (18, 18)}


def test_a_perturbed_engine_log_prob_is_found_at_its_request_and_token():
    """One ulp off in the engine's log-prob of token 3 of request r0.s1 in the caching-on run only."""
    perturbed = {}

    def perturb(run):
        if run.prefix_caching:
            output = run.outputs[1]
            perturbed["was"] = output.log_probs[3]
            output.log_probs[3] = math.nextafter(output.log_probs[3], 0.0)
            perturbed["now"] = output.log_probs[3]

    result = run_ab(_tiny(), trainer_logprobs="matched", on_run=perturb)
    assert result.exit_code() == 1
    off, on = result.trainer_logprobs.runs
    assert (off.tokens, off.bit_identical_tokens, off.first_divergent) == (18, 18, None)
    assert (on.tokens, on.bit_identical_tokens) == (18, 17)
    assert (on.first_divergent.label, on.first_divergent.first_divergent_token) == ("r0.s1", 3)
    figures = on.as_json()
    assert figures["max_abs_diff"] == abs(perturbed["now"] - perturbed["was"]) > 0.0
    assert figures["mean_abs_diff"] == figures["max_abs_diff"] / 18
    assert [r.first_divergent_token for r in on.requests] == [None, 3, None]
    assert (f"trainer vs engine log-probs (matched): B: caching on, ref_zero: 1 of 18 tokens differ; first: "
            f"request r0.s1 (id 1) generated token 3: engine {perturbed['now']!r} vs trainer {perturbed['was']!r}"
            ) in result.failures()


@pytest.mark.parametrize("dtype, identical", [("bf16", [0, 0, 0]), ("fp32", [5, 5, 4])])
def test_megatron_mode_reports_the_mismatch_and_passes(dtype, identical):
    result = run_ab(_tiny(dtype), trainer_logprobs="megatron")
    assert result.failures() == [] and result.exit_code() == 0
    for run in result.trainer_logprobs.runs:  # caching on and off: the same tokens, the same trainer figures
        assert [r.bit_identical_tokens for r in run.requests] == identical
        assert run.as_json()["max_abs_diff"] > 0.0 and run.as_json()["k3_kl"] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [pytest.param(2, 1, id="tp2", marks=pytest.mark.multirank),
                                    pytest.param(1, 2, id="pp2", marks=(pytest.mark.multirank, pytest.mark.breadth))])
def test_tiny_case_matched_multi_rank(tmp_path, torchrun, tp, pp):
    """TP=2 or PP=2 (torchrun, gloo): the training forward (TP: vocabulary shards gathered; PP:
    megatron-core's pipeline schedule, the last stage's log-probs broadcast) matches the engine bit
    for bit on every rank, caching off and on."""
    relative = TINY.relative_to(REPO)  # the fixture writes its JSON under tmp_path by the case's name
    (tmp_path / relative.parent).mkdir(parents=True)
    code, output, result = torchrun.ab(tmp_path, tp=tp, pp=pp, case=str(relative), extra=("--trainer-logprobs",))
    torchrun.assert_clean(tp, pp, code, output, result)
    identical = {"tokens": 18, "bit_identical_tokens": 18, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "k3_kl": 0.0}
    assert result["trainer_logprobs"] == {run: identical for run in RUNS[:2]}


@pytest.mark.slow
@pytest.mark.breadth
def test_weight_update_rounds_compare_each_round_with_its_own_weights(monkeypatch):
    """rl_weight_update (2 SGD steps between 3 rounds; REF_ZERO only, to keep it short): each round's
    requests match the trainer forward with the weights that generated them, bit for bit; r0.s0, in
    flight across update 1, is left out. Compared after the run instead (the final weights for every
    round), rounds 0 and 1 differ in every token, round 2 matches."""
    from megatron_ext.harness import trainer_logprobs

    case = load_case("rl_weight_update").model_copy(update={"prefix_caching_eviction_policies": ["ref_zero"]})
    result = run_ab(case, trainer_logprobs="matched")
    assert result.failures() == []
    assert [run.label for run in result.trainer_logprobs.runs] == list(RUNS[:2])
    for run in result.trainer_logprobs.runs:
        assert (run.tokens, run.bit_identical_tokens, run.left_out) == (72, 72, [0])
    start = trainer_logprobs.TrainerComparison.start
    monkeypatch.setattr(trainer_logprobs.TrainerComparison, "start", lambda self, updater=None: start(self, None))
    stale = run_ab(case, trainer_logprobs="matched")
    round_of = {r["request_id"]: r["round"] for r in stale.requests}
    for run in stale.trainer_logprobs.runs:
        identical = {}  # round -> identical tokens / tokens
        for r in run.requests:
            have = identical.get(round_of[r.request_id], (0, 0))
            identical[round_of[r.request_id]] = (have[0] + r.bit_identical_tokens, have[1] + r.tokens)
        assert run.left_out == [] and identical == STALE_ROUNDS, (run.label, identical)
    assert stale.exit_code() == 1


#: rl_weight_update's rounds compared with the final weights: round -> (identical tokens, tokens)
STALE_ROUNDS = {0: (0, 48), 1: (0, 24), 2: (24, 24)}
