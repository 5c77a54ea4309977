"""What ``ab`` says about the drafts of a speculative run (MTP, ``inference.num_speculative_tokens > 0``):
the speculative audit's counts summed over the runs in ``--json`` (``speculative_drafts``), per run
in the summary table, in the PASS line, and a warning when no draft was accepted; ``soak`` words its
per-run figures the same way (one :class:`DraftCounts`). No engine runs: the runs are made up."""

from __future__ import annotations

from rich.console import Console

from megatron_ext.harness.ab import ABResult, PolicyResult
from megatron_ext.harness.audits.speculative import DraftCounts
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.report import print_report
from megatron_ext.harness.soak import soak_lines, soak_summary
from megatron_ext.harness.step_loop import RunRecord

NONE_ACCEPTED = ("0 of 40 drafts accepted: a run that accepts no draft proves little about draft blocks (no "
                 "accepted draft's KV kept, no rollback after an acceptance); try weights whose drafts the model "
                 "samples more often (another seed, or a trained checkpoint)")


def test_draft_counts_wording_and_total():
    assert DraftCounts(proposed=200, accepted=5).clause() == "5 of 200 drafts accepted"
    assert DraftCounts(proposed=1, accepted=1).clause() == "1 of 1 draft accepted"
    assert DraftCounts(proposed=200, accepted=5).none_accepted_warning() is None
    assert DraftCounts(proposed=40, rejected=40).none_accepted_warning() == NONE_ACCEPTED
    assert DraftCounts.total([DraftCounts(10, 2, 8, 1, 0), DraftCounts(12, 3, 9, 2, 1)]).as_json() == {
        "proposed": 22, "accepted": 5, "rejected": 17, "rejected_across_block": 3, "accepted_across_block": 1}


def result(case_name: str, drafts: list[DraftCounts]) -> ABResult:
    case = load_case(case_name)
    runs = [RunRecord(False, None), *(RunRecord(True, policy) for policy in case.prefix_caching_eviction_policies)]
    for run, counts in zip(runs, drafts):
        run.audit.drafts = counts
        run.counters.blocks_matched = 100 * run.prefix_caching  # meets the case's expectations
    return ABResult(case, "0.19.2", "cpu", [], (True, "ok"), runs[0],
                    [PolicyResult(run.eviction_policy, run, []) for run in runs[1:]])


def report(res: ABResult) -> list[str]:
    console = Console(record=True, width=400)
    print_report(res, console)
    return console.export_text().splitlines()


def test_speculative_run_reports_its_drafts_and_warns_when_none_was_accepted():
    zero = [DraftCounts(proposed=20, rejected=20), DraftCounts(proposed=10, rejected=10),
            DraftCounts(proposed=10, rejected=10)]
    res = result("mtp_speculative_tiny", zero)
    assert res.as_json()["speculative_drafts"] == {"proposed": 40, "accepted": 0, "rejected": 40,
                                                   "rejected_across_block": 0, "accepted_across_block": 0}
    assert res.warnings() == [NONE_ACCEPTED] and res.as_json()["warnings"] == [NONE_ACCEPTED]
    lines = report(res)
    assert f"warning: {NONE_ACCEPTED}" in lines
    assert lines[-1].startswith("PASS: 0 requests bit-identical with prefix caching on and off; every audit holds; "
                                "0 of 40 drafts accepted over 3 runs (none accepted: see the warning) (")
    some = [DraftCounts(200, 5, 195, 21, 0)] * 3
    res = result("mtp_speculative_tiny", some)
    assert res.warnings() == [] and res.as_json()["speculative_drafts"]["accepted"] == 15
    lines = report(res)
    assert "; 15 of 600 drafts accepted over 3 runs (" in lines[-1]
    header = next(line for line in lines if "drafts proposed" in line)
    assert "drafts accepted" in header and "speculative violations" in header
    summary = soak_summary(res)
    assert all(run["drafts"] == some[0].as_json() for run in summary["runs"].values())
    assert all(", 5 of 200 drafts accepted, 21 rejections across a block boundary" in line
               for line in soak_lines(summary))


def test_a_run_without_speculative_decoding_says_nothing_of_drafts():
    res = result("rl_rollouts", [DraftCounts()] * 3)
    assert res.speculative_drafts() is None and "speculative_drafts" not in res.as_json()
    lines = report(res)
    assert not any("draft" in line for line in lines)
