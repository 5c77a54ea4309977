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

import pytest

from functional_tests.conftest import SERIES

REPO = Path(__file__).resolve().parents[1]

#: Draft counts of every run (caching off, ref_zero, lru) on 0.19.2, measured.
DRAFTS = {"proposed": 200, "accepted": 5, "rejected": 195, "rejected_across_block": 21, "accepted_across_block": 0}


def run_cli(tmp_path: Path, *args: str) -> tuple[int, str, Path]:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", *args, "--json", str(out)], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout[-4000:] + proc.stderr[-4000:], out


@pytest.mark.slow
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
    # the drafts summed over the 3 runs, in the PASS line too; some accepted, so no warning
    assert report["speculative_drafts"] == {key: 3 * value for key, value in DRAFTS.items()}
    assert report["warnings"] == []
    assert "every audit holds; 15 of 600 drafts accepted over 3 runs (" in output
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


#: A case without a model section: the model (1 MTP layer, repeated) comes from the checkpoint's args.
FROM_CHECKPOINT = """name: mtp_from_checkpoint
inference: {block_size_tokens: 8, buffer_size_gb: 0.002, max_requests: 8, max_tokens: 256, max_sequence_length: 128,
            num_speculative_tokens: 2}
prefix_caching_eviction_policies: [ref_zero]
requests:
  - {prompt: "Summarize why the sky", samples: 2, num_tokens_to_generate: 30}
  - {prompt: "Summarize why the sea is", arrival_step: 3, num_tokens_to_generate: 30}
"""


@pytest.mark.slow
@pytest.mark.breadth
@pytest.mark.skipif(SERIES != "0.19", reason="2 drafts from 1 repeated MTP layer run on 0.19 only (refused "
                                              "on 0.17 / 0.18: test_mtp_speculative_tiny checks that)")
def test_mtp_checkpoint_round_trip(tmp_path):
    """save-checkpoint writes the MTP layers and Megatron-LM's mtp_* args; ab --load builds the MTP
    model from those args and runs it bit-identical (drafts counted as measured on 0.19.2)."""
    saved = subprocess.run([sys.executable, "-m", "megatron_ext", "save-checkpoint", "--case", "mtp_speculative_tiny",
                            str(tmp_path / "ckpt")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    case = tmp_path / "case.yaml"
    case.write_text(FROM_CHECKPOINT)
    code, output, out = run_cli(tmp_path, "ab", "--case", str(case), "--load", str(tmp_path / "ckpt"))
    report = json.loads(out.read_text())
    assert (code, report["failures"]) == (0, []), output
    assert report["weights"]["model"] == "checkpoint args"
    assert report["model_features"] == ["mtp", "speculative:2"]
    assert report["baseline"]["audit"]["drafts"] == {"proposed": 90, "accepted": 3, "rejected": 87,
                                                     "rejected_across_block": 10, "accepted_across_block": 0}


#: Tokens the trainer compares per run of the rounds case, measured: with 1 draft per step 0.17.1's
#: engine gives the two round-2 requests 5 of their 6 tokens, caching on and off alike (0.18.2: 6).
TRAINER_TOKENS = {"0.17": 70, "0.18": 72, "0.19": 72}


def mtp_rounds_case(drafts: int) -> str:
    """``rl_weight_update`` (3 rounds, 2 train steps, suspend/resume) on ``mtp_speculative_tiny``'s
    model with ``drafts`` draft tokens per step, as case YAML."""
    from megatron_ext.harness.cases import dump_case, load_case

    case, mtp = load_case("rl_weight_update"), load_case("mtp_speculative_tiny")
    return dump_case(case.model_copy(update={
        "name": "mtp_rounds", "model": mtp.model,
        "inference": case.inference.model_copy(update={"num_speculative_tokens": drafts})}))


@pytest.mark.slow
def test_mtp_rounds_with_train_steps_and_trainer_logprobs(tmp_path):
    """Speculative decoding across two training steps and a suspend/resume: bit-identical, no stale
    hit, the speculative audit clean, and the trainer's log-probs equal the engine's bit for bit
    (the in-flight request, generated under two weight versions, left out). 2 drafts on 0.19, 1
    (one per MTP layer, what 0.17 / 0.18 run) elsewhere."""
    drafts = 2 if SERIES == "0.19" else 1
    case = tmp_path / "mtp_rounds.yaml"
    case.write_text(mtp_rounds_case(drafts))
    code, output, out = run_cli(tmp_path, "ab", "--case", str(case), "--trainer-logprobs")
    report = json.loads(out.read_text())
    assert (code, report["failures"], report["bit_identical"]) == (0, [], True), output
    assert report["model_features"] == ["mtp", f"speculative:{drafts}"]
    assert (report["speculative_violations"], report["stale_hits"], report["num_requests"]) == (0, 0, 13)
    assert {name: (run["tokens"], run["bit_identical_tokens"], run["left_out_tokens"])
            for name, run in report["trainer_logprobs"].items()} == {
        name: (TRAINER_TOKENS[SERIES], TRAINER_TOKENS[SERIES], 24)
        for name in ("A: caching off", "B: caching on, ref_zero", "B: caching on, lru")}


def evict_resume_outputs(report: dict) -> list[dict]:
    """Each run's outputs (caching off, ref_zero, lru): request ID -> (tokens, log-probs)."""
    runs = [report["baseline"]] + [p["run"] for p in report["policies"]]
    return [{rid: (o["tokens"], o["log_probs"]) for rid, o in run["outputs"].items()} for run in runs]


@pytest.mark.slow
@pytest.mark.skipif(SERIES != "0.19", reason="2 drafts from 1 repeated MTP layer run on 0.19 only (refused "
                                              "on 0.17 / 0.18: test_mtp_speculative_tiny checks that)")
def test_mtp_evict_resume_fault_s1(tmp_path):
    """``mtp_evict_resume`` (fault S1): a request resumes across a block boundary while another is
    evicted in one update_requests. Patched: every audit clean, bit-identical, each run's tokens
    and log-probs equal to the same case without speculation, bit for bit. With S1's patch skipped
    the KV-write audit flags the resumed request's writes into the evicted request's block (one per
    run) and the resumed request's log-probs differ between caching off and on."""
    code, output, out = run_cli(tmp_path, "ab", "--case", "mtp_evict_resume")
    report = json.loads(out.read_text())
    assert (code, report["failures"], report["bit_identical"]) == (0, [], True), output
    for run in [report["baseline"]] + [p["run"] for p in report["policies"]]:
        assert (run["audit"]["kv_write_violations"], run["audit"]["speculative_violations"]) == (0, 0)
        assert (run["pressure"]["total_blocks"], run["pressure"]["requests_evicted"]) == (4, 1)
    plain = tmp_path / "plain.yaml"  # the same case without speculation: what greedy drafts must not change
    plain.write_text((REPO / "megatron_ext/harness/cases/mtp_evict_resume.yaml").read_text()
                     .replace("num_speculative_tokens: 2", "num_speculative_tokens: 0"))
    (tmp_path / "plain").mkdir()
    code, output, plain_out = run_cli(tmp_path / "plain", "ab", "--case", str(plain))
    assert code == 0, output
    assert evict_resume_outputs(report) == evict_resume_outputs(json.loads(plain_out.read_text()))

    skip = subprocess.run([sys.executable, "-m", "megatron_ext", "ab", "--case", "mtp_evict_resume", "--json",
                           str(tmp_path / "skip.json")], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TRITON_INTERPRET": "1", "MEGATRON_EXT_SKIP": "spec-block-ids-after-eviction"})
    skipped = json.loads((tmp_path / "skip.json").read_text())
    assert skip.returncode == 1, skip.stdout[-3000:] + skip.stderr[-3000:]
    assert skipped["failures"][0] == ("fault S1 (spec-block-ids-after-eviction): 3 KV writes into blocks not in "
                                      "the writer's block table")
    for run in [skipped["baseline"]] + [p["run"] for p in skipped["policies"]]:
        assert run["audit"]["examples"] == {"kv_write_foreign": ["step 1: request 1 wrote KV into block 3, not in "
                                                                 "its block table"]}
