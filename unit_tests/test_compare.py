"""A/B comparison: bit equality, first divergence, deltas."""

from __future__ import annotations

import math

import pytest

from megatron_ext.harness.compare import RequestOutput, compare_request, compare_runs, top_n_miscounted


def out(tokens, log_probs, steps=None, top_n=None):
    return RequestOutput(7, "r0.s0", 5, list(tokens), list(log_probs),
                         list(steps or range(len(tokens))), top_n)


def test_identical_runs():
    diff = compare_request(out([1, 2], [-0.5, -1.25]), out([1, 2], [-0.5, -1.25]))
    assert diff.identical and diff.first_divergent_position is None
    assert diff.max_abs_delta_log_prob == 0.0


def test_last_bit_difference_in_a_log_prob_is_found():
    b_value = -1.25 + 2.0**-52  # one ulp of 1.25
    diff = compare_request(out([1, 2, 3], [-0.5, -1.25, -2.0], [3, 4, 5]),
                           out([1, 2, 3], [-0.5, b_value, -2.0], [3, 4, 5]))
    assert diff.tokens_equal and not diff.log_probs_equal and not diff.identical
    assert diff.first_divergent_position == 1
    assert diff.first_divergent_step == 4
    assert diff.max_abs_delta_log_prob == 2.0**-52
    assert diff.abs_delta_log_prob == [0.0, 2.0**-52, 0.0]


def test_token_divergence_and_length_mismatch():
    diff = compare_request(out([1, 2, 9], [-0.5, -1.0, -3.0]), out([1, 2, 4], [-0.5, -1.0, -3.0]))
    assert not diff.tokens_equal and diff.log_probs_equal
    assert diff.first_divergent_position == 2
    shorter = compare_request(out([1, 2], [-0.5, -1.0]), out([1], [-0.5]))
    assert shorter.first_divergent_position == 1 and not shorter.log_probs_equal


def test_top_n_log_probs_compared_bitwise_when_recorded():
    top = [[("a", -0.5), ("b", -1.25)], [("c", -0.25), ("a", -2.0)]]
    a = out([1, 2], [-0.5, -0.25], top_n=top)
    assert compare_request(a, out([1, 2], [-0.5, -0.25], top_n=[list(t) for t in top])).top_n_logprobs_equal is True
    assert compare_request(a, out([1, 2], [-0.5, -0.25])).top_n_logprobs_equal is None
    one_ulp = [top[0], [("c", -0.25), ("a", math.nextafter(-2.0, 0.0))]]
    diff = compare_request(a, out([1, 2], [-0.5, -0.25], steps=[4, 6], top_n=one_ulp))
    assert (diff.top_n_logprobs_equal, diff.identical) == (False, False)
    assert (diff.tokens_equal, diff.log_probs_equal) == (True, True)
    assert (diff.first_divergent_position, diff.first_divergent_step) == (1, 6)
    reordered = [[("b", -1.25), ("a", -0.5)], top[1]]
    assert compare_request(a, out([1, 2], [-0.5, -0.25], top_n=reordered)).first_divergent_position == 0


def test_runs_must_hold_the_same_requests():
    with pytest.raises(ValueError, match=r"only in A \[7\], only in B \[\]"):
        compare_runs({7: out([1], [-0.5])}, {})


def test_top_n_differing_only_in_an_extra_entry_names_a_position():
    top = [[("a", -0.5)], [("c", -0.25)]]
    diff = compare_request(out([1, 2], [-0.5, -0.25], top_n=top), out([1, 2], [-0.5, -0.25], top_n=top + [[("z", -9.0)]]))
    assert (diff.top_n_logprobs_equal, diff.first_divergent_position, diff.first_divergent_step) == (False, 2, None)


def test_top_n_miscounted_names_requests_without_one_entry_per_token():
    entry = [("a", -0.5), ("b", -1.0)]
    outputs = {
        0: RequestOutput(0, "r0.s0", 5, [1, 2], [-0.5, -0.5], [0, 1], [entry, entry]),  # one per token
        1: RequestOutput(1, "r1.s0", 5, [1, 2], [-0.5, -0.5], [0, 1], [entry] * 3),  # a chunk's extra
        2: RequestOutput(2, "r2.s0", 5, [1, 2], [-0.5, -0.5], [0, 1], None),  # top-n not asked for
        3: RequestOutput(3, "r3.s0", 5, [], [], [], []),  # never ran (the run ended early)
        4: RequestOutput(4, "r4.s0", 5, [1], [-0.5], [0], []),
    }
    assert top_n_miscounted(outputs) == ["r1.s0", "r4.s0"]
