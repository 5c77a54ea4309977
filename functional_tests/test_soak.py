"""``megatron-ext soak`` at CI size: a generated workload of shared prefixes under KV pressure.

One ``soak`` command (caching off once, on per eviction policy) with chunked prefill on and one
with it off; the tests then
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

from megatron_ext import cli

CI_REQUESTS, CI_SEED = 100, 0
REQUESTS = int(os.environ.get("MEGATRON_EXT_SOAK_REQUESTS", str(CI_REQUESTS)))
SEED = int(os.environ.get("MEGATRON_EXT_SOAK_SEED", str(CI_SEED)))


@pytest.fixture(scope="module", params=["chunked prefill",  # without chunked prefill: the newest release only
                                        pytest.param("no chunked prefill", marks=pytest.mark.breadth)])
def soak(request, tmp_path_factory):
    """``(exit code, JSON)`` of ``megatron-ext soak --requests REQUESTS --seed SEED``, patched,
    with chunked prefill on (the soak's default) and off."""
    path = tmp_path_factory.mktemp("soak") / "soak.json"
    chunking = ["--no-chunked-prefill"] if request.param == "no chunked prefill" else []
    code = cli.main(["soak", "--requests", str(REQUESTS), "--seed", str(SEED), "--json", str(path),
                     "--no-progress", "--width", "160", *chunking])
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
    assert run["audit"]["lru_violations"] == 0
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
def test_soak_lru_is_bit_identical_audit_clean_and_stressed(soak):
    _assert_clean_and_stressed(soak[1], "lru")
    assert soak[1]["soak"]["runs"]["lru"]["error"] is None


@pytest.mark.slow
def test_soak_exit_code_and_verdict(soak):
    code, report = soak
    assert report["soak"]["requests"] == REQUESTS
    assert report["kv_write_violations"] == 0 and report["refcount_violations"] == 0
    assert report["lru_violations"] == 0
    assert code == 0 and report["verdict"] == "pass" and report["failures"] == []
