"""``scripts/bench.py --short`` runs every section and writes a complete JSON report.

Sections 1-5 in one run, section 6 (``weight_update``) in its own (each within a 600 s timeout).

Checks the shape of the report (every section present, numeric medians and ratios) and its verdict
structure (issue 33: a verdict per judged section and row; the admission path reports µs added per
admission with a paired interval and carries no verdict), not the timings themselves: ``--short``
uses tiny sizes and a few repetitions.
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


def _section_verdict_ok(verdict: dict, rows: list, target) -> None:
    """A judged section's verdict: its result follows from its rows' verdicts."""
    assert verdict["target"] == target and verdict["measure"]
    counts = {name: sum(r["verdict"] == name for r in rows) for name in ("PASS", "FAIL", "n/a")}
    assert verdict["rows"] == counts
    assert verdict["result"] == ("FAIL" if counts["FAIL"] else "PASS" if counts["PASS"] else "n/a")


def _added_ok(added: dict, rounds: int) -> None:
    """µs added per admission: the paired median inside its interval, one difference per round."""
    assert _number(added["diff"]) and added["diff_lo"] <= added["diff"] <= added["diff_hi"], added
    assert added["n"] == rounds


def _engine_rows_ok(section: dict) -> None:
    """Sections 3, 5, 6b: every row judged by the added time per engine step, paired by round."""
    assert section["target"] == 1.01
    for row in section["rows"]:
        for variant in ("patched", "unpatched"):
            for key in ("step_cpu_us", "step_wall_us", "run_cpu_ms", "run_wall_ms"):
                _stats_ok(row["variants"][variant][key])
        ratio = row["ratios"]["patched/unpatched"]
        _ratio_ok(ratio)
        per_step = ratio["per_step_cpu"]
        assert per_step["n"] == row["runs"] and per_step["ratio_lo"] <= per_step["ratio"] <= per_step["ratio_hi"]
        assert row["added_us_per_step"] == {k: per_step[k] for k in ("diff", "diff_lo", "diff_hi", "n")}
        judged = row["same_work"] and not any(row["errors"].values())
        assert row["verdict"] == (("PASS" if per_step["ratio"] <= 1.01 else "FAIL") if judged else "n/a")
        assert row["resolved"] is not (per_step["ratio_lo"] <= 1.01 < per_step["ratio_hi"])
    _section_verdict_ok(section["verdict"], section["rows"], 1.01)
    assert section["verdict"]["unresolved"] == sum(r["verdict"] != "n/a" and not r["resolved"] for r in section["rows"])


def test_short_bench_prints_the_tables_and_writes_every_section(tmp_path):
    report_path = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--short", "--sections", "release,add_request,e2e,lru",
         "--json", str(report_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for title in ("1. Release path", "1c. Release path, flat in pool size", "2. Admission path",
                  "3. End to end", "4a. Release cost vs pool size", "5. LRU under memory pressure"):
        assert title in done.stdout, done.stdout[-3000:]
    for line in ("release path vs 0.19.2 + deregister-own-hash: ",
                 "add_request, µs the patches add per admission over the baseline (paired, median row "
                 "(least to most); not judged): none ",
                 "add_request with the source patches instead: none ",
                 "end to end: ", "LRU under pressure: ", "the patches' added time per engine step <= 1%: "):
        assert line in done.stdout, done.stdout[-3000:]

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
        assert row["verdict"] == ("PASS" if row["ratios"]["patched/upstream+ext"]["cpu"] <= 1.0 else "FAIL")
        assert row["same_result_as_upstream"] is True  # the patched release does what 0.19.2 does
    # judged against 0.19.2 with the same fault set fixed: fault 9's fix is all it needs on this path
    assert report["release"]["baseline_patches"] == ["deregister-own-hash"]
    flat = report["release"]["flatness"]
    assert [(f["policy"], f["ids"], f["pools"]) for f in flat] == [
        (p, n, [1024, 4096]) for p in ("REF_ZERO", "LRU") for n in (1, 64)]
    for f in flat:
        assert f["allowed_growth"] == pytest.approx(1.10 * max(f["baseline_growth"], f["control_growth"]))
        assert f["verdict"] == ("PASS" if f["patched_growth"] <= f["allowed_growth"] else "FAIL")
    _section_verdict_ok(report["release"]["verdict"], release + flat,
                        {"patched/upstream+ext": 1.0, "pool_growth_over_baseline_or_control": 1.1})

    add = report["add_request"]["rows"]
    assert {(r["policy"], r["match"]) for r in add} == {
        (p, m) for p in ("REF_ZERO", "LRU") for m in ("full", "partial", "none")}
    for row in add:
        for variant in ("patched", "unpatched"):
            _stats_ok(row["variants"][variant]["cpu_us"])
            _stats_ok(row["variants"][variant]["wall_us"])
        _ratio_ok(row["ratios"]["patched/unpatched"])
        assert "verdict" not in row and row["baseline"] == "unpatched"  # 0.19.2: its own code
        _added_ok(row["added_us"]["patched"], 2)
        _added_ok(row["added_us"]["source"], 2)
        assert row["added_us"]["patched"]["diff"] == row["ratios"]["patched/unpatched"]["paired_cpu"]["diff"]
        # every patch on every function it wraps: the probe's outcome is the same either way
        assert row["outcomes"]["patched"]["blocks_matched"] == row["outcomes"]["unpatched"]["blocks_matched"]
        # the source-patched tree does the runtime patches' work (matches, tokens, dummy-block writes)
        assert row["outcomes"]["source"] == row["outcomes"]["patched"]
        assert row["source_check"] == "same work"
    assert report["add_request"]["verdict"]["result"] == "none"
    assert set(report["add_request"]["by_match"]) == {"none", "partial", "full"}
    assert all(m["rows"] == 4 and m["min_us"] <= m["median_row_us"] <= m["max_us"]
               for m in report["add_request"]["by_match"].values())

    assert report["e2e"]["rows"]
    _engine_rows_ok(report["e2e"])
    _engine_rows_ok(report["lru"])

    lru = report["lru"]["rows"]
    assert [(r["release"], r["policy"]) for r in lru] == [("0.19.2", "lru")]
    for row in lru:  # 0.19.2 unpatched survives this case: a real ratio
        assert row["errors"] == {"unpatched": None, "patched": None}
        assert row["same_work"] and row["same_outputs"]
        calls = row["variants"]["patched"]["inside_calls"]
        assert calls["add_request"] > 0 and calls["resume_paused_requests"] > 0
        assert calls["initialize_attention_state"] == row["variants"]["patched"]["engine_steps"][0]

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
    assert "weight-update add_request, µs fault 8's wrappers add per admission (paired, median row " in out
    assert "weight-update engine step (all patches / all but fault 8): " in out
    assert "the patches' added time per engine step <= 1%: " in out
    assert "weight-update flush (100 registered blocks, 1,024-block pool): " in out

    report = json.loads(report_path.read_text())
    assert set(report) == {"meta", "weight_update"}
    section = report["weight_update"]
    assert section["targets"] == {"e2e_per_step": 1.01, "flush_ms": 5.0}
    parts = section["verdict"]["parts"]
    assert set(parts) == {"add_request", "e2e", "flush"} and parts["add_request"]["result"] == "none"
    judged = [parts["e2e"]["result"], parts["flush"]["result"]]
    assert section["verdict"]["result"] == ("FAIL" if "FAIL" in judged else "PASS")
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
        assert "verdict" not in row
        _added_ok(row["added_us"]["fault8"], 2)
        _added_ok(row["added_us"]["passthrough8"], 2)
    assert "DynamicInferenceContext.initialize_attention_state" in section["add_request"]["wrapped"]
    assert {r["outcomes"]["fault8"]["blocks_matched"] for r in add if r["match"] == "full"} == {4, 8}

    e2e = section["e2e"]["rows"]
    assert e2e
    for row in e2e:
        assert row["errors"] == {"unpatched": None, "patched": None}
        assert row["same_work"] and row["same_outputs"]
    _engine_rows_ok(section["e2e"])
    assert section["e2e"]["verdict"] == parts["e2e"]

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
    _section_verdict_ok(parts["flush"], flush, 5.0)
    assert {(r["state"]["held"], r["state"]["cached_ref0"]) for r in flush} >= {(0, 100), (100, 0)}
