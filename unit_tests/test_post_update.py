"""The post-update reference's bookkeeping (:mod:`megatron_ext.harness.post_update`), on recorded runs:
which weight version each request ran under, which are left out, and what a difference reports.
The fresh engines themselves run in functional_tests (test_weight_updates, test_hybrid_rounds, test_mla)."""

from __future__ import annotations

import dataclasses

from megatron_ext.harness.compare import RequestOutput
from megatron_ext.harness.post_update import Difference, PostUpdateReference, RunReference, _compare, _split
from megatron_ext.harness.step_loop import RunRecord
from megatron_ext.harness.weight_updates import UpdateRecord


def _run() -> RunRecord:
    """r0 decodes across the update of step 3; r1 before it; r2 from step 3 on (the update comes
    first in its step); r3 after the second update (step 6); r4 added but never produced a token."""
    run = RunRecord(True, "lru")
    for rid, steps in {0: [1, 2, 3, 4], 1: [0, 1], 2: [3, 4], 3: [6, 7], 4: []}.items():
        run.outputs[rid] = RequestOutput(rid, f"r{rid}.s0", 5, tokens=[10 + i for i in range(len(steps))],
                                         log_probs=[-1.0 - i for i in range(len(steps))], token_steps=steps)
    run.updates = [UpdateRecord(1, 3, "perturb", True, in_flight=[0]), UpdateRecord(2, 6, "perturb", True)]
    return run


def test_each_request_is_compared_under_the_version_it_ran_and_one_across_an_update_is_left_out():
    reference = _split(_run(), versions=3)
    assert reference.compared == {1: 0, 2: 1, 3: 2}
    assert reference.left_out == [0]


def test_identical_outputs_pass_and_count_every_token():
    run = _run()
    reference = _split(run, versions=3)
    _compare(run, reference, {rid: run.outputs[rid] for rid in reference.compared})
    assert (reference.tokens_compared, reference.max_abs_diff, reference.first_difference) == (6, 0.0, None)
    result = PostUpdateReference(runs=[reference], versions=3)
    assert result.failures() == []
    assert result.pass_clause() == ("after every weight update the engine equals a fresh model and engine on the current "
                                    "weights (3 weight versions; 3 requests, 6 tokens compared over the runs, 1 in "
                                    "flight across an update not)")


def test_a_log_prob_bit_names_the_update_the_request_and_the_token():
    run = _run()
    reference = _split(run, versions=3)
    fresh = {rid: dataclasses.replace(run.outputs[rid], tokens=list(run.outputs[rid].tokens),
                                      log_probs=list(run.outputs[rid].log_probs)) for rid in reference.compared}
    fresh[2].log_probs = [-1.0, -2.0 + 2 ** -20]  # one low bit in r2's second token
    fresh[3].tokens = [10, 99]  # r3 samples another second token
    _compare(run, reference, fresh)
    assert reference.differing == ["r2.s0", "r3.s0"]
    assert reference.first_difference == Difference("B: caching on, lru", 1, "r2.s0", 1, (11, -2.0),
                                                    (11, -2.0 + 2 ** -20))
    assert reference.max_abs_diff == 2 ** -20
    assert reference.tokens_compared == 2 + 2 + 1  # r1 both, r2 both (the second differs in bits), r3 the first
    [line] = PostUpdateReference(runs=[reference, RunReference("A: caching off")], versions=3).failures()
    assert line == ("post-update reference: 2 requests differ from a fresh model and engine on the weights they ran "
                    "under, in 1 of 2 runs (the engine ran something computed under older weights, e.g. prefix-cached KV "
                    "(fault 8), Mamba's decode cache (H11) or MLA's split KV up-projection (M1)); first: B: caching on, "
                    "lru: under weight update 1, request r2.s0 "
                    "generated token 1 is 11 (log-prob -2.0) in the engine but 11 (log-prob -1.9999990463256836) in a "
                    "fresh model and engine on the same weights; max |Δ log-prob| 9.54e-07")


def test_not_run_says_why_and_is_no_failure():
    result = PostUpdateReference(not_run="sampling is not greedy (top_k 0)")
    assert result.failures() == []
    assert result.as_json() == {"checked": False, "why_not": "sampling is not greedy (top_k 0)", "weight_versions": 0,
                                "passed": None, "runs": []}
