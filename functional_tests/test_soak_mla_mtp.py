"""``megatron-ext soak --mla`` and ``soak --mtp`` at CI size (40 requests, seed 0), in a fresh
interpreter (``run_cli`` of ``test_mtp_speculative``: Triton's interpreter for the MTP kernels).

``--mla``: ``mla_tiny``'s multi-latent attention model, latent KV cache in blocks of 64 tokens, a
pool sized so no request waits (both runs prefill the same requests in the same steps). 0.18 and
0.19: bit-identical, every audit clean, 640 latent writes of recomputed tokens sent to the dummy
block (``matched-block-writes`` on the latent path). 0.17 refuses MLA by name (exit 2).

``--mtp``: ``mtp_speculative_tiny``'s model, 2 drafts per decode step, blocks of 8 tokens, a pool of
96 blocks that fills (megatron-core evicts requests with caching on; LRU evicts cached blocks).
0.19: bit-identical, no hash-registered block holds a draft, every rollback whole. 0.17 / 0.18
draft at most one token per MTP layer and refuse it by name (exit 2).
"""

from __future__ import annotations

import json

import pytest

from functional_tests.conftest import SERIES
from functional_tests.test_mtp_speculative import run_cli

RUNS = ("caching off", "ref_zero", "lru")

#: soak --mla --requests 40 --seed 0 per run (caching off, ref_zero, lru), 0.18.2 and 0.19.2, measured
#: 2026-12-07: blocks matched, KV (latent) writes checked, writes sent to the dummy block, peak pool use.
MLA_FIGURES = ((0, 5998, 0, "25/27"), (16, 4590, 640, "19/27"), (17, 4462, 640, "19/27"))

#: soak --mtp --requests 40 --seed 0 on 0.19.2 per run, measured 2026-12-07: blocks matched, requests
#: evicted, cached blocks evicted, drafts proposed / accepted / rejected across a block boundary.
MTP_FIGURES = ((0, 0, 0, 698, 1, 82), (132, 2, 0, 694, 1, 82), (148, 3, 40, 692, 1, 82))


def soak(tmp_path, model: str) -> tuple[int, str, dict]:
    code, output, out = run_cli(tmp_path, "soak", model, "--requests", "40", "--seed", "0", "--no-progress")
    return code, output, (json.loads(out.read_text()) if code != 2 else {})


def assert_clean(code: int, output: str, report: dict) -> dict:
    """Exit 0, bit-identical, no failure, every shared audit 0; the runs' figures by name."""
    assert (code, report["failures"], report["bit_identical"]) == (0, [], True), output
    runs = report["soak"]["runs"]
    assert tuple(runs) == RUNS
    for run in runs.values():
        assert run["error"] is None
        assert (run["kv_write_violations"], run["refcount_violations"], run["lru_violations"],
                run["stale_hits"]) == (0, 0, 0, 0)
    return runs


@pytest.mark.slow
def test_soak_mla_latent_writes_of_recomputed_tokens_go_to_the_dummy_block(tmp_path):
    code, output, report = soak(tmp_path, "--mla")
    if SERIES == "0.17":
        assert code == 2 and "Traceback" not in output, output
        assert "multi-latent attention with prefix caching does not run on megatron-core 0.17.1" in output
        return
    runs = assert_clean(code, output, report)
    assert report["model_features"] == ["mla"]
    assert tuple((r["blocks_matched"], r["kv_writes_checked"], r["kv_writes_redirected"], r["peak_pool_use"])
                 for r in runs.values()) == MLA_FIGURES
    assert {r["engine_steps"] for r in runs.values()} == {48}  # no request waits: the same steps on and off


@pytest.mark.slow
def test_soak_mtp_drafts_are_never_registered_and_every_rollback_is_whole(tmp_path):
    code, output, report = soak(tmp_path, "--mtp")
    if SERIES in ("0.17", "0.18"):
        assert code == 2 and "Traceback" not in output, output
        assert (f"num_speculative_tokens=2 with mtp_num_layers=1 (mtp_use_repeated_layer) needs megatron-core "
                f"0.19: {SERIES} drafts at most one token per MTP layer") in output
        return
    runs = assert_clean(code, output, report)
    assert report["model_features"] == ["mtp", "speculative:2"]
    for run in runs.values():
        assert (run["draft_block_violations"], run["spec_rewind_violations"]) == (0, 0)
        assert run["drafts"]["rejected"] == run["drafts"]["proposed"] - run["drafts"]["accepted"]
    assert tuple((r["blocks_matched"], r["requests_evicted"], r["cached_blocks_evicted"], r["drafts"]["proposed"],
                  r["drafts"]["accepted"], r["drafts"]["rejected_across_block"]) for r in runs.values()) == MTP_FIGURES
