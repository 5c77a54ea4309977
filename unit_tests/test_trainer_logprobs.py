"""``ab --trainer-logprobs`` without an engine: the k3 estimate, the per-token comparison, the JSON
shape, the verdict (a differing token, no token compared, a trainer forward that raised), the PASS
line's clause and the refusals (one line, exit 2, nothing run)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megatron_ext import cli
from megatron_ext.harness import ab
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.compare import RequestOutput
from megatron_ext.harness.trainer_logprobs import (
    RunLogProbs, TrainerForward, TrainerLogProbs, TrainerLogProbsError, batch_sequences, check_supported,
    compare_run, k3)
from unit_tests.conftest import one_error_line


def test_k3_is_zero_for_equal_log_probs_and_the_estimate_otherwise():
    assert k3(-1.25, -1.25) == 0.0
    # log r = trainer - engine = log 2: r - 1 - log r = 1 - log 2
    assert k3(math.log(0.25), math.log(0.5)) == pytest.approx(1 - math.log(2), rel=1e-15)
    # log r = -log 2: 1/2 - 1 + log 2
    assert k3(math.log(0.5), math.log(0.25)) == pytest.approx(math.log(2) - 0.5, rel=1e-15)
    assert k3(-3.0, -3.0 + 1e-7) == pytest.approx(0.5e-14, rel=1e-6)  # ~ (log r)^2 / 2, never negative


def _outputs(log_probs: dict[int, list[float]]) -> dict[int, RequestOutput]:
    return {rid: RequestOutput(rid, f"r{rid}.s0", 4, tokens=list(range(len(lp))), log_probs=lp)
            for rid, lp in log_probs.items()}


ENGINE = {0: [-0.5, -1.5, -2.0], 1: [-0.25, -3.0], 2: []}


def test_identical_log_probs_give_zeros_and_no_failure():
    run = compare_run("A: caching off", _outputs(ENGINE), ENGINE)
    assert run.as_json() == {"tokens": 5, "bit_identical_tokens": 5, "max_abs_diff": 0.0,
                             "mean_abs_diff": 0.0, "k3_kl": 0.0, "left_out_requests": 0, "left_out_tokens": 0,
                             "routing_replayed": False}
    assert run.first_divergent is None
    assert TrainerLogProbs("matched", [run]).failures() == []
    assert TrainerLogProbs("matched", [run, run]).pass_clause() == (
        "trainer log-probs (matched) bit-identical to the engine's in all 10 compared tokens of 2 runs "
        "(left out, in flight across a weight update: 0 requests, 0 tokens)")


def test_one_perturbed_token_is_found_at_its_request_and_token():
    trainer = {rid: list(lp) for rid, lp in ENGINE.items()}
    trainer[1][1] = math.nextafter(-3.0, 0.0)  # one ulp of a double: still a difference of bits
    run = compare_run("B: caching on, lru", _outputs(ENGINE), trainer)
    first = run.first_divergent
    assert (first.request_id, first.label, first.first_divergent_token) == (1, "r1.s0", 1)
    figures = run.as_json()
    delta = 3.0 - abs(trainer[1][1])
    assert figures["tokens"] == 5 and figures["bit_identical_tokens"] == 4
    assert figures["max_abs_diff"] == delta and figures["mean_abs_diff"] == delta / 5
    assert figures["k3_kl"] == k3(-3.0, trainer[1][1]) / 5 > 0.0
    assert [r.bit_identical_tokens for r in run.requests] == [3, 1, 0]
    assert [r.first_divergent_token for r in run.requests] == [None, 1, None]
    failures = TrainerLogProbs("matched", [run]).failures()
    assert failures == [f"trainer vs engine log-probs (matched): B: caching on, lru: 1 of 5 tokens differ; first: "
                        f"request r1.s0 (id 1) generated token 1: engine -3.0 vs trainer {trainer[1][1]!r}"]
    assert TrainerLogProbs("megatron", [run]).failures() == []  # information only
    run.left_out, run.left_out_tokens = [3, 4], 14
    assert TrainerLogProbs("megatron", [run]).pass_clause() == (
        f"trainer (megatron, for information): 4/5 identical, max |Δ| {delta:.3g} nats "
        "(left out, in flight across a weight update: 2 requests, 14 tokens)")


def test_negative_zero_differs_from_zero():
    run = compare_run("A: caching off", _outputs({0: [0.0]}), {0: [-0.0]})
    assert run.bit_identical_tokens == 0 and run.first_divergent.first_divergent_token == 0


def test_json_is_keyed_by_run_label_with_exactly_the_five_figures():
    runs = [compare_run(label, _outputs(ENGINE), ENGINE)
            for label in ("A: caching off", "B: caching on, ref_zero", "B: caching on, lru")]
    result = TrainerLogProbs("matched", runs)
    assert list(result.as_json()) == ["A: caching off", "B: caching on, ref_zero", "B: caching on, lru"]
    for figures in result.as_json().values():
        assert set(figures) == {"tokens", "bit_identical_tokens", "max_abs_diff", "mean_abs_diff", "k3_kl",
                                "left_out_requests", "left_out_tokens", "routing_replayed"}
    detail = result.detail_json()
    assert detail["mode"] == "matched" and set(detail["seconds"]) == set(result.as_json())
    assert detail["error"] == {label: None for label in result.as_json()}
    assert [r["label"] for r in detail["requests"]["A: caching off"]] == ["r0.s0", "r1.s0", "r2.s0"]
    assert detail["requests"]["A: caching off"][0] == {
        "request_id": 0, "label": "r0.s0", "tokens": 3, "bit_identical_tokens": 3, "max_abs_diff": 0.0,
        "k3_kl": 0.0, "first_divergent_token": None, "engine": ENGINE[0], "trainer": ENGINE[0]}


@pytest.mark.parametrize("mode", ["matched", "megatron"])
def test_a_run_that_compared_no_token_fails_in_any_mode(mode):
    """All its requests in flight across a weight update, or an engine that generated nothing:
    nothing was checked, so the verdict cannot pass (exit 1, as any failure of ab)."""
    spanning = RunLogProbs("A: caching off", left_out=[0, 1], left_out_tokens=12)
    empty = compare_run("B: caching on, lru", _outputs({0: [], 1: []}), {0: [], 1: []})
    assert spanning.as_json()["left_out_requests"] == 2 and spanning.as_json()["left_out_tokens"] == 12
    assert TrainerLogProbs(mode, [spanning, empty]).failures() == [
        f"trainer vs engine log-probs ({mode}): A: caching off: 0 tokens compared, nothing was checked: 2 requests "
        "(12 tokens) left out, in flight across a weight update; a request that finishes before the next update "
        "is compared",
        f"trainer vs engine log-probs ({mode}): B: caching on, lru: 0 tokens compared, nothing was checked: the "
        "engine generated no token"]


def test_counts_that_differ_are_an_error():
    with pytest.raises(ValueError, match="request r0.s0: 3 engine log-probs for 2 trainer log-probs"):
        compare_run("A: caching off", _outputs(ENGINE), {0: [-0.5, -1.5], 1: [], 2: []})


def test_batch_is_right_padded_with_positions_from_zero():
    tokens, positions = batch_sequences([[5, 6, 7], [8]], pad_id=0)
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert positions.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert tokens.dtype == positions.dtype == torch.int64


def test_modes():
    assert TrainerForward.of_mode("matched") == TrainerForward("matched", "batch_invariant")
    assert TrainerForward.of_mode("megatron") == TrainerForward("megatron", "torch")
    assert TrainerForward("matched", "torch").mode == "attention matched, matmuls torch"


def test_bogus_mode_is_one_error_line(nothing_runs, capsys):
    assert cli.main(["ab", "--trainer-logprobs", "bogus", "--no-progress"]) == 2
    assert one_error_line(capsys) == ("megatron-ext: error: --trainer-logprobs 'bogus': choose one of matched, "
                                      "megatron (or give the flag alone for matched)")


def test_bare_flag_means_matched():
    args = cli.build_parser().parse_args(["ab", "--trainer-logprobs", "--case", "rl_rollouts"])
    assert args.trainer_logprobs == "matched" and args.case == "rl_rollouts"
    assert cli.build_parser().parse_args(["ab"]).trainer_logprobs is None


@pytest.mark.parametrize("case, device, tp, pp, message", [
    ("functional_tests/cases/hybrid_tiny.yaml", "cpu", 1, 1, "matched is for GPT models: a hybrid model's training "
     "forward scans each Mamba layer in chunks where the engine's decode steps run the recurrence token by token "
     "(other float arithmetic); use --trainer-logprobs megatron (for information)"),
    ("rl_rollouts", "cuda", 1, 1, "matched needs the CPU backend (--device cpu)"),
])
def test_what_is_not_done_yet_is_refused(case, device, tp, pp, message):
    with pytest.raises(TrainerLogProbsError, match=re.escape(message)):
        check_supported(TrainerForward(), load_case(case), device, tp, pp)


def test_run_ab_refuses_before_building(monkeypatch):
    monkeypatch.setattr(ab, "build_model", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(ab, "apply", lambda *a, **k: pytest.fail("applied the patches"))
    with pytest.raises(TrainerLogProbsError, match="matched is for GPT models"):
        ab.run_ab(load_case("functional_tests/cases/hybrid_tiny.yaml"), trainer_logprobs="matched")
    with pytest.raises(TrainerLogProbsError, match="choose one of matched, megatron"):
        ab.run_ab(load_case("rl_rollouts"), trainer_logprobs="exact")
