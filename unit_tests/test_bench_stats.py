"""The benchmarks' paired estimate (benchmarks/stats.py): exact values on small samples."""

from __future__ import annotations

import pytest

from benchmarks.stats import _median_interval_ranks, paired_summary


@pytest.mark.parametrize("n, ranks", [(1, (0, 0)), (5, (0, 4)), (6, (0, 5)), (8, (0, 7)), (9, (1, 7)),
                                      (16, (3, 12)), (48, (16, 31))])
def test_median_interval_ranks_are_the_sign_test_ranks(n, ranks):
    """The widest inner ranks whose interval still covers the median with >= 95%:
    P(B <= low) <= 0.025 for B ~ Binomial(n, 1/2) (n = 9: P(B <= 1) = 10/512 = 0.0195)."""
    assert _median_interval_ranks(n) == ranks


def test_paired_summary_differences_rounds_not_medians():
    # round-to-round drift of +-50 ns moves both variants alike; the numerator costs 3 ns more
    denominators = [100, 150, 120, 180, 110, 160, 130, 140, 170]
    numerators = [d + extra for d, extra in zip(denominators, [3, 3, 2, 4, 3, 3, 5, 1, 3])]
    summary = paired_summary(numerators, denominators, scale=1)
    assert summary == {"diff": 3, "diff_lo": 2, "diff_hi": 4, "ratio": 1 + 3 / 140,
                       "ratio_lo": 1 + 2 / 140, "ratio_hi": 1 + 4 / 140, "n": 9}


def test_paired_summary_refuses_unpaired_samples():
    with pytest.raises(ValueError, match="equal, non-zero lengths, not 2 and 3"):
        paired_summary([1, 2], [1, 2, 3])
