"""``scripts/bench.py --short`` runs every section and writes a complete JSON report.

Sections 1-5 in one run, section 6 (``weight_update``) in its own (each within a 600 s timeout).

Checks the shape of the report (every section present, numeric medians and ratios, a verdict per
row), not the timings themselves: ``--short`` uses tiny sizes and a few repetitions.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.release_independent

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "scripts" / "bench.py"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _stats_ok(stats: dict) -> None:
    for key in ("median", "q1", "q3", "min", "max"):
        assert _number(stats[key]), (key, stats)
    assert stats["n"] >= 1
    assert stats["min"] <= stats["median"] <= stats["max"]


def _ratio_ok(ratio: dict) -> None:
    assert _number(ratio["cpu"]) and ratio["cpu"] > 0, ratio
    assert _number(ratio["wall"]) and ratio["wall"] > 0, ratio


def test_short_bench_prints_the_tables_and_writes_every_section(tmp_path):
    report_path = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--short", "--sections", "release,add_request,e2e,lru",
         "--json", str(report_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for title in ("1. Release path", "2. Admission path", "3. End to end", "4a. Release cost vs pool size",
                  "5. LRU under memory pressure"):
        assert title in done.stdout, done.stdout[-3000:]

    report = json.loads(report_path.read_text())
    assert report["meta"]["settings"]["short"] is True
    assert _number(report["meta"]["total_s"])

    release = report["release"]["rows"]
    assert {r["policy"] for r in release} == {"REF_ZERO", "LRU"}
    for row in release:
        for variant in ("patched", "unpatched", "upstream", "upstream+ext"):
            _stats_ok(row["variants"][variant]["cpu_us"])
            _stats_ok(row["variants"][variant]["wall_us"])
        _ratio_ok(row["ratios"]["patched/upstream+ext"])
        _ratio_ok(row["ratios"]["patched/upstream"])
        _ratio_ok(row["ratios"]["patched/unpatched"])
        assert row["verdict"] in ("PASS", "FAIL")
        assert row["same_result_as_upstream"] is True  # the patched release does what 0.19.2 does

    add = report["add_request"]["rows"]
    assert {(r["policy"], r["match"]) for r in add} == {
        (p, m) for p in ("REF_ZERO", "LRU") for m in ("full", "partial", "none")}
    for row in add:
        for variant in ("patched", "unpatched"):
            _stats_ok(row["variants"][variant]["cpu_us"])
            _stats_ok(row["variants"][variant]["wall_us"])
        _ratio_ok(row["ratios"]["patched/unpatched"])
        assert _number(row["overhead_us"])
        assert row["target"] == (1.02 if row["match"] == "none" else 1.05)
        assert row["verdict"] in ("PASS", "FAIL")
        # every patch on every function it wraps: the probe's outcome is the same either way
        assert row["outcomes"]["patched"]["blocks_matched"] == row["outcomes"]["unpatched"]["blocks_matched"]
        # the source-patched tree does the runtime patches' work (matches, tokens, dummy-block writes)
        assert row["outcomes"]["source"] == row["outcomes"]["patched"]
        assert row["source_verdict"] in ("PASS", "FAIL")
        paired = row["ratios"]["patched/unpatched"]["paired_cpu"]
        assert paired["diff_lo"] <= paired["diff"] <= paired["diff_hi"] and paired["n"] == 2

    e2e = report["e2e"]["rows"]
    assert e2e
    for row in e2e:
        for variant in ("patched", "unpatched"):
            for key in ("step_cpu_us", "step_wall_us", "run_cpu_ms", "run_wall_ms"):
                _stats_ok(row["variants"][variant][key])
        _ratio_ok(row["ratios"]["patched/unpatched"])
        assert row["verdict"] in ("PASS", "FAIL")

    lru = report["lru"]["rows"]
    assert [(r["release"], r["policy"]) for r in lru] == [("0.19.2", "lru")]
    for row in lru:  # 0.19.2 unpatched survives this case: a real ratio
        assert row["errors"] == {"unpatched": None, "patched": None}
        assert row["same_work"] and row["same_outputs"]
        _ratio_ok(row["ratios"]["patched/unpatched"])
        calls = row["variants"]["patched"]["inside_calls"]
        assert calls["add_request"] > 0 and calls["resume_paused_requests"] > 0
        assert row["verdict"] in ("PASS", "FAIL")

    scaling = report["scaling"]["rows"]
    by_pool = [r for r in scaling if "pool_growth" in r]
    per_id = [r for r in scaling if "us_per_released_id" in r]
    assert by_pool and per_id
    for row in by_pool:
        assert all(_number(v) for v in row["median_us_by_pool"].values())
        assert _number(row["pool_growth"])
    assert all(_number(r["us_per_released_id"]) for r in per_id)


def test_short_weight_update_section_prints_its_rows(tmp_path):
    """Section 6 (fault 8's patch) on 0.19.2: every part runs and prints a row per case."""
    report_path = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--short", "--sections", "weight_update", "--json", str(report_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for title in ("6a. Weight-update invalidation", "6b. Weight-update invalidation",
                  "6c. Weight-update invalidation"):
        assert title in out, out[-3000:]
    for scenario in ("lru_cached", "ref_zero_held", "lru_held", "lru_mixed"):
        assert f"0.19.2  │ {scenario}" in out, out[-3000:]
    assert "weight-update add_request (fault8/unpatched): " in out
    assert "weight-update engine step (all patches / all but fault 8): " in out
    assert "weight-update flush (100 registered blocks, 1,024-block pool): " in out

    report = json.loads(report_path.read_text())
    assert set(report) == {"meta", "weight_update"}
    section = report["weight_update"]
    assert section["targets"] == {"wu_add_request": 1.02, "wu_e2e": 1.01, "wu_flush_ms": 5.0}
    assert section["load_average_start"] and section["load_average_end"]

    add = section["add_request"]["rows"]
    assert {(r["prompt_tokens"], r["match"]) for r in add} == {
        (n, m) for n in (64, 128) for m in ("full", "partial", "none")}
    for row in add:
        assert row["release"] == "0.19.2"
        assert row["same_outcome"] is True  # the wrappers change nothing without an update
        for variant in ("fault8", "passthrough8", "unpatched"):
            _stats_ok(row["variants"][variant]["cpu_us"])
        _ratio_ok(row["ratios"]["fault8/unpatched"])
        _ratio_ok(row["ratios"]["passthrough8/unpatched"])
        assert _number(row["overhead_us"]) and _number(row["passthrough_overhead_us"])
        assert row["verdict"] in ("PASS", "FAIL")
    assert {r["outcomes"]["fault8"]["blocks_matched"] for r in add if r["match"] == "full"} == {4, 8}

    e2e = section["e2e"]["rows"]
    assert e2e
    for row in e2e:
        assert row["errors"] == {"unpatched": None, "patched": None}
        assert row["same_work"] and row["same_outputs"]
        _ratio_ok(row["ratios"]["patched/unpatched"])
        assert row["verdict"] in ("PASS", "FAIL")

    flush = section["flush"]["rows"]
    assert [r["scenario"] for r in flush] == ["lru_cached", "ref_zero_held", "lru_held", "lru_mixed"]
    for row in flush:
        state, did = row["state"], row["outcomes"]["flush"]
        assert state["pool_blocks"] == 1024 and state["registered"] == 100
        # the flush frees every ref-0 block and unhashes every held one; age-out frees none
        assert (did["blocks_unreachable"], did["blocks_freed"]) == (state["held"], state["cached_ref0"])
        assert did["hash_map"] == 0 and did["still_hashed_ref0"] == 0 and did["still_hashed_held"] == 0
        assert did["free_pool_gain"] == state["cached_ref0"]
        aged = row["outcomes"]["age_out"]
        assert aged["hash_map"] == 0 and aged["still_hashed_ref0"] == state["cached_ref0"]
        assert aged["free_pool_gain"] == 0
        for variant in ("flush", "age_out"):
            _stats_ok(row["variants"][variant]["cpu_ms"])
        assert _number(row["median_ms"]["flush"])
        assert row["verdict"] in ("PASS", "FAIL")
    assert {(r["state"]["held"], r["state"]["cached_ref0"]) for r in flush} >= {(0, 100), (100, 0)}
