"""Timing samples: the timing loop, and order statistics (nanoseconds in, microseconds out)."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Iterable, Sequence


def time_calls(prepare: Callable[[], None], call: Callable[[], None], reps: int) -> tuple[list[int], list[int]]:
    """``reps`` times: ``prepare()`` untimed, then ``call()`` timed. Returns (wall ns, thread CPU ns)
    per call. The garbage collector is off meanwhile (no gc.collect(): with torch and
    megatron-core loaded it takes ~0.1 s per batch)."""
    wall: list[int] = []
    cpu: list[int] = []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            prepare()
            w0, c0 = clock(), cpu_clock()
            call()
            c1, w1 = cpu_clock(), clock()
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return wall, cpu


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending sequence (numpy's default method)."""
    if not sorted_values:
        raise ValueError("quantile of an empty sample")
    position = (len(sorted_values) - 1) * q
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(samples_ns: Iterable[int | float], scale: float = 1e-3) -> dict[str, float]:
    """Median, quartiles, IQR, min, max and count of a sample, in ``ns * scale`` units (µs by default)."""
    values = sorted(float(v) * scale for v in samples_ns)
    return {
        "median": quantile(values, 0.5),
        "q1": quantile(values, 0.25),
        "q3": quantile(values, 0.75),
        "iqr": quantile(values, 0.75) - quantile(values, 0.25),
        "min": values[0],
        "max": values[-1],
        "n": len(values),
    }


def ratio_summary(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, float]:
    """Spread of per-round ratios ``numerators[i] / denominators[i]`` (median, min, max, quartiles).

    Each round is a short interleaved batch of both variants, so a round's ratio is little affected
    by load drift on the machine; the spread over rounds says how far the overall ratio can be trusted.
    """
    ratios = sorted(n / d for n, d in zip(numerators, denominators) if d > 0)
    if not ratios:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"),
                "min": float("nan"), "max": float("nan"), "n": 0}
    return {
        "median": statistics.median(ratios),
        "q1": quantile(ratios, 0.25),
        "q3": quantile(ratios, 0.75),
        "min": ratios[0],
        "max": ratios[-1],
        "n": len(ratios),
    }


def paired_summary(numerators: Sequence[float], denominators: Sequence[float], scale: float = 1e-3) -> dict[str, float]:
    """The numerator's extra cost from per-round pairs: round ``i`` timed both variants back to back.

    ``diff`` is the median of the per-round differences ``numerators[i] - denominators[i]`` (in
    ``ns * scale`` units, µs by default), with a distribution-free ~95% interval of that median
    (order statistics of the differences, sign-test ranks); ``ratio``, ``ratio_lo`` and ``ratio_hi``
    are ``1 + diff / median(denominators)`` for each. Differencing within a round cancels the load
    drift that moves both variants alike, so this is the estimate verdicts use where the extra cost
    is a few percent of the call (the ratio of medians moves by more than that between runs).

    Raises:
        ValueError: no pair, or unequal lengths.
    """
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"paired samples need equal, non-zero lengths, not {len(numerators)} and {len(denominators)}")
    diffs = sorted((n - d) * scale for n, d in zip(numerators, denominators))
    base = statistics.median(denominators) * scale
    low, high = _median_interval_ranks(len(diffs))
    diff = statistics.median(diffs)
    return {"diff": diff, "diff_lo": diffs[low], "diff_hi": diffs[high], "ratio": 1 + diff / base,
            "ratio_lo": 1 + diffs[low] / base, "ratio_hi": 1 + diffs[high] / base, "n": len(diffs)}


def _median_interval_ranks(n: int, confidence: float = 0.95) -> tuple[int, int]:
    """0-based ranks ``(low, n - 1 - low)`` of the sorted sample bounding its median with at least
    ``confidence`` (sign test: the interval covers the median with probability ``1 - 2 P(B <= low)``,
    ``B ~ Binomial(n, 1/2)``; ``low`` is the largest with ``P(B <= low) <= (1 - confidence) / 2``);
    ``(0, n - 1)`` when ``n`` is too small for any."""
    from math import comb

    tail = (1 - confidence) / 2
    cumulative, low = 0.0, -1
    while low + 1 < n:
        cumulative += comb(n, low + 1) / 2 ** n
        if cumulative > tail:
            break
        low += 1
    low = max(0, min(low, (n - 1) // 2))
    return low, n - 1 - low
