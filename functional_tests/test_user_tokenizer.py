"""``ab --tokenizer``: a Hugging Face tokenizer trained in the test (nothing downloaded), loaded
through megatron-core's tokenizers, drives the prompts of a JSONL file through the real engine."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from megatron_ext import cli
from megatron_ext.harness.tokenizer import default_tokenizer
from unit_tests.tokenizer_factory import TEXT, save_hf, train_bpe

SYSTEM = TEXT[0] + " " + TEXT[2] + " "
QUESTIONS = ["What is a KV block?", "What is a block table?", "What does LRU evict first?"]


def sha256_of(ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


@pytest.mark.slow
def test_hf_tokenizer_with_jsonl_prompts_is_bit_identical_and_audit_clean(tmp_path, capfd):
    trained = train_bpe(200)
    directory = save_hf(trained, tmp_path / "bpe200")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": SYSTEM + QUESTIONS[0], "samples": 2},
        {"prompt": SYSTEM + QUESTIONS[1], "arrival_step": 3},
        {"prompt": SYSTEM + QUESTIONS[2], "num_tokens_to_generate": 12, "arrival_step": 6},
    ]) + "\n")
    out = tmp_path / "ab.json"
    code = cli.main(["ab", "--case", "lru_pressure", "--prompts", str(prompts), "--tokenizer", str(directory),
                     "--tokenizer-library", "huggingface", "--no-progress", "--json", str(out)])
    report = capfd.readouterr().out
    assert code == 0, report
    result = json.loads(out.read_text())
    assert result["tokenizer"] == {"library": "huggingface", "path": str(directory), "vocab_size": 200,
                                   "eod": 2, "fingerprint": "5cec33d044392efa"}
    assert f"tokenizer: huggingface from {directory} (200 token IDs, end-of-document 2)" in report
    # the prompts the engine got are the trained tokenizer's IDs (not bytes: 161-168 bytes each)
    ids = [trained.encode(SYSTEM + q).ids for q in QUESTIONS]
    assert [len(i) for i in ids] == [39, 40, 39]
    assert [(r["label"], r["prompt_length"], r["prompt_sha256"]) for r in result["requests"]] == [
        ("r0.s0", 39, sha256_of(ids[0])), ("r0.s1", 39, sha256_of(ids[0])),
        ("r1.s0", 40, sha256_of(ids[1])), ("r2.s0", 39, sha256_of(ids[2]))]
    assert result["bit_identical"] and result["failures"] == [] and result["verdict"] == "pass"
    assert (result["kv_write_violations"], result["refcount_violations"], result["lru_violations"]) == (0, 0, 0)
    assert result["blocks_matched"] > 0 and result["prefill_tokens_skipped"] > 0
    # the engine stops at the tokenizer's end-of-document (2), else after num_tokens_to_generate;
    # the model's IDs 200-256 (no text in this tokenizer) are detokenized without an error
    outputs = result["baseline"]["outputs"]
    for rid, wanted in (("0", 8), ("1", 8), ("2", 8), ("3", 12)):
        tokens = outputs[rid]["tokens"]
        assert len(tokens) == wanted or (0 < len(tokens) < wanted and tokens[-1] == 2), (rid, tokens)
    generated = [t for o in outputs.values() for t in o["tokens"]]
    assert all(0 <= t < 257 for t in generated) and max(generated) >= 200
    assert report.splitlines()[-1].startswith("PASS: 4 requests bit-identical")

    # compare: the file against itself passes; against a run made with another tokenizer it refuses
    assert cli.main(["compare", str(out), str(out)]) == 0
    capfd.readouterr()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**result, "tokenizer": default_tokenizer().as_json()}))
    assert cli.main(["compare", str(out), str(other)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"megatron-ext: error: {out}:off and {other}:off were made with different tokenizers (A: "
                   f"huggingface {directory} vs B: byte-level: library huggingface vs byte-level); compare "
                   "runs made with the same tokenizer"]
