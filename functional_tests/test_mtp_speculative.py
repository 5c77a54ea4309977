"""``mtp_speculative_tiny`` (MTP speculative decoding, 2 drafts per step from 1 repeated MTP layer)
through ``megatron-ext ab``: caching on vs off bit for bit, the speculative audit clean, the draft
counts read back from the JSON. 0.19 runs it; 0.17 / 0.18 draft at most one token per MTP layer and
``ab`` refuses it there (exit 2, one line). Runs ``python -m megatron_ext`` in a fresh interpreter
with Triton's interpreter on (megatron-core's Triton MTP kernels), as the hybrid cases do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from functional_tests.conftest import SERIES

REPO = Path(__file__).resolve().parents[1]

#: Draft counts of every run (caching off, ref_zero, lru) on 0.19.2, measured.
DRAFTS = {"proposed": 200, "accepted": 5, "rejected": 195, "rejected_across_block": 21, "accepted_across_block": 0}


def run_cli(tmp_path: Path, *args: str) -> tuple[int, str, Path]:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", *args, "--json", str(out)], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout[-4000:] + proc.stderr[-4000:], out


def test_mtp_speculative_tiny(tmp_path):
    code, output, out = run_cli(tmp_path, "ab", "--case", "mtp_speculative_tiny")
    if SERIES in ("0.17", "0.18"):  # explicit per-release gating: refused by name before anything is built
        assert code == 2, output
        assert (f"case 'mtp_speculative_tiny': num_speculative_tokens=2 with mtp_num_layers=1 "
                f"(mtp_use_repeated_layer) needs megatron-core 0.19: {SERIES} drafts at most one token per MTP "
                "layer") in output
        assert "Traceback" not in output
        return
    report = json.loads(out.read_text())
    assert (code, report["failures"], report["bit_identical"]) == (0, [], True), output
    assert report["model_features"] == ["mtp", "speculative:2"]
    assert report["speculative_violations"] == 0
    assert report["blocks_matched"] == 14
    runs = [report["baseline"]] + [p["run"] for p in report["policies"]]
    assert [p["eviction_policy"] for p in report["policies"]] == ["ref_zero", "lru"]
    for run in runs:
        audit = run["audit"]
        assert run["error"] is None
        assert (audit["kv_write_violations"], audit["refcount_violations"], audit["lru_violations"],
                audit["speculative_violations"]) == (0, 0, 0, 0), audit["examples"]
        assert audit["drafts"] == DRAFTS
    assert [len(o["tokens"]) for o in report["baseline"]["outputs"].values()] == [18, 18, 15, 15, 15, 30]
