"""The speculative-decoding audit (harness/audits/speculative.py) on megatron-core's real engine
(``mtp_speculative_tiny`` with one draft per step, every release 0.17-0.19) and on deliberately
broken variants: a block holding only drafts registered early, a block of accepted tokens registered
under a wrong hash, and a rollback that never happens.
Each runs in a fresh interpreter under Triton's interpreter (``scripts/probes/speculative_audit.py``)."""

from __future__ import annotations

from unit_tests.conftest import run_triton_probe

#: drafts of mtp_speculative_tiny with one draft per step (seed 8), the same with caching off and on
DRAFTS = {"proposed": 100, "accepted": 5, "rejected": 95, "rejected_across_block": 10, "accepted_across_block": 0}


def test_clean_engine_has_no_speculative_violation():
    probe = run_triton_probe("speculative_audit", "clean")
    for run in probe["runs"].values():
        assert (run["error"], run["speculative_violations"], run["drafts"]) == (None, 0, DRAFTS)


def test_draft_block_registered_early_is_named():
    probe = run_triton_probe("speculative_audit", "early_register")
    assert probe["injected"] == {"step": 2, "block": 510, "request_id": 0}
    run = probe["runs"]["ref_zero"]
    assert run["counts"] == {"draft_block": 1, "spec_rewind": 0}
    assert run["first"]["draft_block"] == [[
        "draft_block", 2, 510, 0,
        "block 510 (entry 3 of request 0, positions 24-31) is hash-registered but holds 8 positions past the "
        "request's 24 accepted tokens (drafts or nothing)"]]
    assert probe["runs"]["off"]["counts"] == {"draft_block": 0, "spec_rewind": 0}


def test_block_registered_under_a_wrong_hash_is_named():
    """A complete block of accepted tokens registered again under a made-up hash: named every step the
    request holds it (13 steps), never with caching off (no hash map)."""
    probe = run_triton_probe("speculative_audit", "wrong_hash")
    assert probe["injected"] == {"step": 0, "block": 514, "request_id": 3}
    run = probe["runs"]["ref_zero"]
    assert run["counts"] == {"draft_block": 13, "spec_rewind": 0}
    assert run["first"]["draft_block"] == [[
        "draft_block", step, 514, 3, "block 514 (entry 0 of request 3) is registered under a hash that is not "
        "the chain hash of the accepted tokens it holds"] for step in (0, 1, 2)]
    assert probe["runs"]["off"]["counts"] == {"draft_block": 0, "spec_rewind": 0}


def test_rollback_left_undone_is_named():
    probe = run_triton_probe("speculative_audit", "no_rewind")
    for name, first_blocks in (("off", [507, 508, 509]), ("ref_zero", [510, 513, 512])):
        run = probe["runs"][name]
        assert run["counts"] == {"draft_block": 0, "spec_rewind": 72}
        assert [v[:4] for v in run["first"]["spec_rewind"]] == [
            ["spec_rewind", 1, first_blocks[0], 0], ["spec_rewind", 1, first_blocks[1], 1 if name == "off" else 2],
            ["spec_rewind", 1, first_blocks[2], 2 if name == "off" else 3]]
        assert run["first"]["spec_rewind"][0][4] == (
            "request 0 with 23 accepted tokens, next forward up to position 23: KV length 23 (expected 22), "
            "blocks 4 (expected 3), last block offset 0 (expected 7)")
        assert run["drafts"]["accepted"] == 0  # the drafts verified against a stale KV never match here
