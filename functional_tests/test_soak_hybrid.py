"""``megatron-ext soak --hybrid`` at CI size: the soak's generated workload (rollouts, multi-turn
conversations, shared system prompts) on a tiny hybrid (Mamba + attention) model.

One command (caching off once, on per eviction policy) in a fresh interpreter with Triton's
interpreter on (``run_cli`` of ``test_hybrid_cases``); the tests read its JSON. Seed 5's 8 requests
hold a rollout of 4 samples of a 33-token prompt and a 4-turn conversation (8-71 tokens), so the
siblings and the later turns restore Mamba snapshots taken *inside* an earlier prompt's prefill
(at 16, 32 and 48), which no shipped case does. About 60-90 s of CPU time per release.

``MEGATRON_EXT_SOAK_HYBRID_REQUESTS`` / ``MEGATRON_EXT_SOAK_HYBRID_SEED`` change size and seed.
"""

from __future__ import annotations

import os

import pytest

from functional_tests.test_hybrid_cases import UNPATCHED, run_cli, runs

REQUESTS = int(os.environ.get("MEGATRON_EXT_SOAK_HYBRID_REQUESTS", "8"))
SEED = int(os.environ.get("MEGATRON_EXT_SOAK_HYBRID_SEED", "5"))


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> tuple[int, dict, str]:
    """(exit code, JSON, output) of ``megatron-ext soak --hybrid --requests REQUESTS --seed SEED``."""
    return run_cli(tmp_path_factory.mktemp("soak-hybrid"), "soak", "--hybrid", "--requests", str(REQUESTS),
                   "--seed", str(SEED), "--no-progress")


@pytest.mark.slow
def test_every_request_runs_and_every_audit_holds(soak):
    code, report, output = soak
    assert report["num_requests"] == REQUESTS and report["case"] == f"soak-{REQUESTS}-seed{SEED}-hybrid"
    for name, run in runs(report).items():
        assert run["error"] is None, output
        assert len(run["outputs"]) == REQUESTS and all(len(o["tokens"]) > 0 for o in run["outputs"].values())
        audit = run["audit"]
        assert (audit["kv_write_violations"], audit["refcount_violations"], audit["lru_violations"],
                audit["mamba_restore_violations"]) == (0, 0, 0, 0), audit["examples"]
        if name == "off":
            assert (audit["mamba_restores"], run["counters"]["blocks_matched"]) == (0, 0)
            continue
        assert run["counters"]["blocks_matched"] > 0 and run["counters"]["prefill_tokens_skipped"] > 0
        assert audit["mamba_restores"] > 0 and audit["mamba_restores_failed"] == 0
        summary = report["soak"]["runs"][name]
        assert (summary["mamba_restores"], summary["mamba_restore_violations"]) == (audit["mamba_restores"], 0)


#: Seed 5's hybrid soak differs with caching on vs off in 4 of its 8 requests on 0.18.2 and 0.19.2
#: (the same 4, max |Δ log-prob| 2.4e-7 - 4.8e-7, tokens equal) and 5 on 0.17.1 (no clamp there: all
#: three siblings restore r1.s0's snapshot at 32, taken inside its prefill): r0.t3.s0 restored a Mamba snapshot
#: taken inside r0.t2's prefill (at 48); r1.s1, r1.s3 (rollout siblings, the clamp left them no
#: skip) and r0.t2.s0 (no Mamba match) restored nothing, recomputed tokens inside matched KV blocks
#: and diverge at a later decode step. (A quick check: two requests admitted together or a step
#: apart, caching off, gave bit-identical outputs, so batch composition alone does not explain it.)
#: Unchanged with faults H7 and H8 fixed (0.19.2, merged main). Open; strict: a fix shows as XPASS.
class CachingOnDiffers(AssertionError):
    """Caching on is not bit-identical to off (the only failure the xfail below expects: a broken
    run, a timeout or a failed audit still fails the test)."""


_HYBRID_SOAK_DIFFERS = pytest.mark.xfail(
    not UNPATCHED and SEED == 5 and REQUESTS == 8, strict=True, raises=CachingOnDiffers,
    reason="hybrid soak: 4 of 8 requests differ by ~1e-7 (recomputation inside matched blocks without "
           "a restore; not H7/H8): open")


@pytest.mark.slow
@_HYBRID_SOAK_DIFFERS
def test_caching_on_is_bit_identical_to_off(soak):
    code, report, output = soak
    differing = [(p["eviction_policy"], r["label"], r["max_abs_delta_log_prob"])
                 for p in report["policies"] for r in p["requests"] if not r["identical"]]
    if differing:
        raise CachingOnDiffers(differing)
    assert (code, report["failures"]) == (0, []), output
