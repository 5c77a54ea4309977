"""The shipped hybrid (Mamba + attention) cases through ``megatron-ext ab``: prefix caching on vs
off bit for bit, with the KV-write and Mamba snapshot audits read back from the JSON.

Hybrid runs need Triton's interpreter, which Triton reads when it is first imported, so each runs
``python -m megatron_ext ab`` in a fresh interpreter with :data:`megatron_ext.cpu_backend.mamba.TRITON_CPU_ENV`
set from its start (the approach of ``functional_tests/test_hybrid.py``; the command line here, so
the whole JSON, audits included, comes back). With ``MEGATRON_EXT_TEST_UNPATCHED=1`` the command
runs ``--unpatched`` and the tests fail on every release: the recomputed tokens of ``hybrid_prefix``
write KV into matched blocks (fix 2), and ``hybrid_chunked``'s restores / skips change with the
Mamba fixes (H3 on 0.17, H5 on 0.17 and 0.18). About 50-60 s of CPU time per case (0.19.2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from functional_tests.conftest import SERIES
from megatron_ext.cpu_backend.mamba import TRITON_CPU_ENV

UNPATCHED = os.environ.get("MEGATRON_EXT_TEST_UNPATCHED", "") == "1"
REPO = Path(__file__).resolve().parents[1]
#: Wall-clock limit of one command (s): 1-2 minutes on a quiet 2-core machine, 10-15 at load 20.
TIMEOUT_S = int(os.environ.get("MEGATRON_EXT_HYBRID_TIMEOUT_S", "1800"))


def run_cli(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    """``python -m megatron_ext ARGS --json FILE`` in a fresh interpreter with Triton's interpreter
    on (``--unpatched`` when the tests run unpatched): (exit code, the JSON, stdout + stderr)."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "megatron_ext", *args, "--json", str(out), "--width", "200",
               *(("--unpatched",) if UNPATCHED else ())]
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, **TRITON_CPU_ENV}, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert out.exists(), output
    return proc.returncode, json.loads(out.read_text()), output


def runs(report: dict) -> dict[str, dict]:
    """Run name (``off``, ``ref_zero``, ``lru``) -> that run's JSON."""
    return {"off": report["baseline"], **{p["eviction_policy"]: p["run"] for p in report["policies"]}}


def assert_bit_identical(code: int, report: dict, output: str) -> None:
    """Exit 0, verdict pass, every request bit-identical in every caching-on run, no audit violation."""
    assert (code, report["failures"]) == (0, []), output
    assert report["bit_identical"] and report["verdict"] == "pass"
    assert [p["eviction_policy"] for p in report["policies"]] == ["ref_zero", "lru"]
    for run in runs(report).values():
        assert run["error"] is None
        assert all(len(o["tokens"]) > 0 for o in run["outputs"].values())
        audit = run["audit"]
        assert (audit["kv_write_violations"], audit["refcount_violations"], audit["lru_violations"],
                audit["mamba_restore_violations"]) == (0, 0, 0, 0), audit["examples"]
    assert report["mamba_restore_violations"] == 0 and report["mamba_restores_failed"] == 0
    baseline = runs(report)["off"]["audit"]
    assert (baseline["mamba_restores"], baseline["kv_writes_redirected"]) == (0, 0)  # caching off


def restores(run: dict) -> list[tuple[int, int, int, bool]]:
    """A run's Mamba restores as (step, request ID, tokens skipped, restored)."""
    return [(r["step"], r["request_id"], r["tokens_skipped"], r["restored"]) for r in run["audit"]["mamba_restore_log"]]


@pytest.mark.slow
@pytest.mark.breadth  # fix 2 is checked under every release by its unit tests, restores by test_hybrid_chunked
def test_hybrid_prefix(tmp_path):
    """Restores of prompt-end snapshots at 32 (r1, r3) and 80 (r2); r3's tokens 32-48 and all of
    r4's 16 tokens are recomputed inside hash-matched blocks, so their KV writes go to the dummy
    block (one attention layer: 32 writes); unpatched they land in the shared blocks."""
    code, report, output = run_cli(tmp_path, "ab", "--case", "hybrid_prefix")
    assert_bit_identical(code, report, output)
    for policy in ("ref_zero", "lru"):
        run = runs(report)[policy]
        assert (run["counters"]["blocks_matched"], run["counters"]["prefill_tokens_skipped"]) == (11, 144)
        assert restores(run) == [(1, 1, 32, True), (2, 2, 80, True), (2, 3, 32, True)]
        blocks = [r["block"] for r in run["audit"]["mamba_restore_log"]]
        assert blocks[0] == blocks[2] != blocks[1]  # r1 and r3 restore r0's prompt end (block 1)
        assert run["audit"]["kv_writes_redirected"] == 32


#: Step of r2's restore in ``hybrid_chunked``: 0.17 / 0.18 spend the budget on the span (skip
#: included), so r1's first chunk ends at 48 (on the Mamba grid, fault H9's fix), its rest fills step 2
#: and r2, with 10 tokens left there and no whole Mamba chunk, waits for step 3.
R2_RESTORE_STEP = {"0.17": 3, "0.18": 3, "0.19": 2}


@pytest.mark.slow
def test_hybrid_chunked(tmp_path):
    """r1 (101 tokens) and r2 (63) each restore r0's one-block prompt end at 16 on their first
    prefill chunk and prefill the rest in chunks of at most 64 tokens."""
    code, report, output = run_cli(tmp_path, "ab", "--case", "hybrid_chunked")
    assert_bit_identical(code, report, output)
    for policy in ("ref_zero", "lru"):
        run = runs(report)[policy]
        assert (run["counters"]["blocks_matched"], run["counters"]["prefill_tokens_skipped"]) == (2, 32)
        assert restores(run) == [(1, 1, 16, True), (R2_RESTORE_STEP[SERIES], 2, 16, True)]
        assert len({r["block"] for r in run["audit"]["mamba_restore_log"]}) == 1  # r0's block
        assert run["steps"] == runs(report)["off"]["steps"] == 5
