"""``megatron-ext soak`` at CI size: a generated workload of shared prefixes under KV pressure.

One ``soak`` command (caching off once, on per eviction policy) per test module; the tests then
check its JSON exactly: every request of the workload ran, prefix caching on is bit-identical to
off, no audit violation, nothing leaked at drain, blocks were matched, and the workload really
pressed on the pool (requests paused or evicted, cached blocks evicted).

``MEGATRON_EXT_SOAK_REQUESTS`` / ``MEGATRON_EXT_SOAK_SEED`` change the size (default 100) and
seed (default 0), e.g. ``MEGATRON_EXT_SOAK_REQUESTS=2000`` for the full soak (about 20 minutes).
"""

from __future__ import annotations

import json
import os

import pytest

from megatron_ext import cli, mcore

SERIES = mcore.release_series(mcore.installed_version())
CI_REQUESTS, CI_SEED = 100, 0
REQUESTS = int(os.environ.get("MEGATRON_EXT_SOAK_REQUESTS", str(CI_REQUESTS)))
SEED = int(os.environ.get("MEGATRON_EXT_SOAK_SEED", str(CI_SEED)))

# Upstream LRU faults outside megatron-ext's two fixes, with what megatron-core raises:
# 0.17/0.18 evict a parent block before its cached child (KeyError in _find_kv_match_count, see
# test_ab_cases.py); 0.19 counts a child twice when a later prefill chunk registers a block it got
# by a hash match again, so after that child is evicted its parent never becomes an evictable leaf
# and the leaf peel in evict_lru_blocks asserts ("parent graph is not a forest").
LRU_FAULTS = {
    "0.17": ("KeyError", "_find_kv_match_count"),
    "0.18": ("KeyError", "_find_kv_match_count"),
    "0.19": ("AssertionError: leaf peel evicted", "evict_lru_blocks"),
}
# Releases whose LRU run hits its fault at the CI size (measured): strict there, so the test
# fails when that changes. Other sizes or seeds may or may not hit it: not strict then (at 2000
# requests, seed 0, 0.18.2 hits its KeyError at step 327; 0.17.1 and 0.18.2 pass at the CI size).
LRU_FAULT_AT_CI_SIZE = {"0.19"}
AT_CI_SIZE = (REQUESTS, SEED) == (CI_REQUESTS, CI_SEED)


class KnownUpstreamLRUFault(Exception):
    """megatron-core raised the known LRU fault of this release (see LRU_FAULTS)."""


def _hit_lru_fault(report: dict) -> bool:
    error = _policy(report, "lru")["run"]["error"] or ""
    return SERIES in LRU_FAULTS and all(part in error for part in LRU_FAULTS[SERIES])


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """``(exit code, JSON)`` of ``megatron-ext soak --requests REQUESTS --seed SEED``, patched."""
    path = tmp_path_factory.mktemp("soak") / "soak.json"
    code = cli.main(["soak", "--requests", str(REQUESTS), "--seed", str(SEED), "--json", str(path),
                     "--no-progress", "--width", "160"])
    return code, json.loads(path.read_text())


def _policy(report: dict, policy: str) -> dict:
    return next(p for p in report["policies"] if p["eviction_policy"] == policy)


def _assert_clean_and_stressed(report: dict, policy: str) -> None:
    entry = _policy(report, policy)
    run, baseline = entry["run"], report["baseline"]
    assert baseline["error"] is None and run["error"] is None
    assert report["num_requests"] == REQUESTS
    assert len(run["outputs"]) == len(baseline["outputs"]) == REQUESTS
    # every request ran in both runs (the harness lists unrun requests too, with no tokens)
    assert all(len(o["tokens"]) > 0 for o in baseline["outputs"].values())
    assert all(len(o["tokens"]) > 0 for o in run["outputs"].values())
    assert entry["bit_identical"] and all(r["identical"] for r in entry["requests"])
    assert run["audit"]["kv_write_violations"] == 0
    assert run["audit"]["refcount_violations"] == 0  # drain included: nothing leaked
    assert 0 < run["audit"]["steps_checked"] <= run["steps"]  # idle steps are not audited
    assert run["counters"]["blocks_matched"] > 0 and run["counters"]["prefill_tokens_skipped"] > 0
    pressure = run["pressure"]
    assert pressure["total_blocks"] == 48 and pressure["peak_blocks_held"] > 40
    # the workload must prove it stressed the cache: requests paused or evicted, cached blocks evicted
    assert pressure["requests_paused"] + pressure["requests_evicted"] > 0, pressure
    if policy == "lru":
        assert pressure["cached_blocks_evicted"] > 0, pressure
    else:
        assert pressure["blocks_deregistered_at_ref_zero"] > 0, pressure


@pytest.mark.slow
def test_soak_ref_zero_is_bit_identical_audit_clean_and_stressed(soak):
    _assert_clean_and_stressed(soak[1], "ref_zero")
    assert soak[1]["soak"]["runs"]["ref_zero"]["error"] is None


@pytest.mark.slow
@pytest.mark.xfail((SERIES in LRU_FAULT_AT_CI_SIZE) if AT_CI_SIZE else (SERIES in LRU_FAULTS),
                   raises=KnownUpstreamLRUFault, strict=AT_CI_SIZE,
                   reason=f"upstream LRU fault of {SERIES}: {LRU_FAULTS.get(SERIES)}")
def test_soak_lru_is_bit_identical_audit_clean_and_stressed(soak):
    if _hit_lru_fault(soak[1]):
        raise KnownUpstreamLRUFault(_policy(soak[1], "lru")["run"]["error"])
    _assert_clean_and_stressed(soak[1], "lru")


@pytest.mark.slow
def test_soak_exit_code_and_verdict(soak):
    code, report = soak
    assert report["soak"]["requests"] == REQUESTS
    assert report["kv_write_violations"] == 0 and report["refcount_violations"] == 0
    if _hit_lru_fault(report):  # fails only for the LRU run, and says so
        assert code == 1 and report["verdict"] == "fail"
        assert report["failures"] and all("lru" in f for f in report["failures"]), report["failures"]
    else:
        assert code == 0 and report["verdict"] == "pass" and report["failures"] == []
