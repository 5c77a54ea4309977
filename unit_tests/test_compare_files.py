"""``megatron-ext compare``: runs recorded in ab/soak JSON files, compared bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_ext import cli
from megatron_ext.harness.recorded import RecordedRunError, compare_recorded, load_runs, pair_runs, parse_spec

LOG_PROBS = [-0.6931471805599453, -1.3862943611198906, -2.0794415416798357]


def ab_json(path: Path, case: str = "x", log_probs=LOG_PROBS, prompt_sha="aa", label="r0.s0",
            policies=("ref_zero", "lru")) -> Path:
    """A minimal file of the shape 'ab --json' writes: one request of three generated tokens per run."""
    def run(lps):
        return {"outputs": {"7": {"label": label, "tokens": [5, 6, 7], "log_probs": list(lps),
                                  "token_steps": [3, 4, 5]}}}

    data = {"case": case, "megatron_core_version": "0.19.2", "device": "cpu",
            "requests": [{"request_id": 7, "label": label, "prompt_length": 4, "prompt_sha256": prompt_sha}],
            "baseline": run(LOG_PROBS),
            "policies": [{"eviction_policy": p, "run": run(log_probs)} for p in policies]}
    path.write_text(json.dumps(data))
    return path


def test_float64_log_probs_survive_the_file_bit_for_bit(tmp_path):
    runs = load_runs(ab_json(tmp_path / "a.json"))
    assert list(runs) == ["off", "ref_zero", "lru"]
    assert runs["lru"].outputs[7].log_probs == LOG_PROBS
    assert runs["lru"].source == f"{tmp_path / 'a.json'}:lru"
    assert runs["off"].requests[7]["prompt_sha256"] == "aa"


def test_spec_names_a_run_or_none():
    assert parse_spec("dir/a.json:lru") == (Path("dir/a.json"), "lru")
    assert parse_spec("dir/a.json:off") == (Path("dir/a.json"), "off")
    assert parse_spec("C:/x/a.json") == (Path("C:/x/a.json"), None)


def test_pairs_by_name_or_as_named(tmp_path):
    a, b = ab_json(tmp_path / "a.json"), ab_json(tmp_path / "b.json", policies=("lru",))
    assert [(x.name, y.name) for x, y in pair_runs(str(a), str(b))] == [("off", "off"), ("lru", "lru")]
    assert [(x.name, y.name) for x, y in pair_runs(f"{a}:off", f"{b}:lru")] == [("off", "lru")]
    assert [(x.name, y.name) for x, y in pair_runs(f"{a}:lru", str(b))] == [("lru", "lru")]
    with pytest.raises(RecordedRunError, match=r"b.json holds no run 'ref_zero'; it holds: off, lru"):
        pair_runs(f"{a}:ref_zero", str(b))


def test_one_ulp_apart_is_a_divergence_at_that_token(tmp_path):
    changed = list(LOG_PROBS)
    changed[1] = math.nextafter(changed[1], 0.0)
    a, b = ab_json(tmp_path / "a.json"), ab_json(tmp_path / "b.json", log_probs=changed)
    (x, y), = pair_runs(f"{a}:lru", f"{b}:lru")
    diff, = compare_recorded(x, y).diffs
    assert diff.tokens_equal and not diff.log_probs_equal
    assert diff.first_divergent_position == 1 and diff.first_divergent_step == 4
    assert diff.max_abs_delta_log_prob == abs(changed[1] - LOG_PROBS[1]) > 0


@pytest.mark.parametrize("change, message", [
    ({"prompt_sha": "bb"}, "request 7: prompt (SHA-256 of its tokens) aa vs bb"),
    ({"label": "r9.s0"}, "request 7: label 'r0.s0' vs 'r9.s0'"),
])
def test_runs_of_other_prompts_are_refused(tmp_path, change, message):
    a, b = ab_json(tmp_path / "a.json"), ab_json(tmp_path / "b.json", **change)
    (x, y), *_ = pair_runs(str(a), str(b))
    with pytest.raises(RecordedRunError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compare_recorded(x, y)


def test_cli_exit_codes_and_verdict_last(tmp_path, capsys):
    a = ab_json(tmp_path / "a.json")
    changed = [LOG_PROBS[0], LOG_PROBS[1], LOG_PROBS[2] + 1e-3]
    b = ab_json(tmp_path / "b.json", log_probs=changed)
    out = tmp_path / "cmp.json"
    assert cli.main(["compare", str(a), str(a)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "PASS: 1 requests bit-identical in 3 compared run pair(s)"
    assert cli.main(["compare", str(a), str(b), "--json", str(out)]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"FAIL: 2 of 3 compared requests differ; first: r0.s0 (id 7) in {a}:ref_zero vs {b}:ref_zero, "
                           "at generated token 2 (engine step 5 of B)")
    written = json.loads(out.read_text())
    assert written["verdict"] == "fail"
    assert [p["bit_identical"] for p in written["pairs"]] == [True, False, False]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1)"),
    ('{"case": "x"}', "not an ab/soak result (no 'baseline' and 'policies')"),
])
def test_cli_bad_files_exit_2_with_one_line(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    assert cli.main(["compare", str(bad), str(ab_json(tmp_path / "a.json"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"megatron-ext: error: {bad}") and message in err[0]


def test_cli_directory_exits_2(tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path), str(ab_json(tmp_path / "a.json"))]) == 2
    assert f"{tmp_path} is a directory" in capsys.readouterr().err


def test_runs_of_other_request_ids_are_refused(tmp_path):
    a, b = ab_json(tmp_path / "a.json"), ab_json(tmp_path / "b.json")
    data = json.loads(b.read_text())
    for run in [data["baseline"]] + [p["run"] for p in data["policies"]]:
        run["outputs"] = {"8": run["outputs"]["7"]}
    b.write_text(json.dumps(data))
    (x, y), *_ = pair_runs(str(a), str(b))
    with pytest.raises(RecordedRunError, match=r"request IDs only in A \[7\], only in B \[8\]"):
        compare_recorded(x, y)


def test_file_with_an_unknown_run_name_blames_the_run(tmp_path):
    a = ab_json(tmp_path / "a.json")
    with pytest.raises(RecordedRunError, match=r"a.json:bogus: 'bogus' is not a run; name one of off, ref_zero, lru"):
        parse_spec(f"{a}:bogus")


BYTE_LEVEL = {"library": "byte-level", "path": None, "vocab_size": 257, "eod": 256, "fingerprint": "b8a4b1d26c7a1182"}


def test_runs_made_with_different_tokenizers_are_refused(tmp_path, capsys):
    a, b = ab_json(tmp_path / "a.json"), ab_json(tmp_path / "b.json")
    hf = {"library": "huggingface", "path": "/t/bpe", "vocab_size": 200, "eod": 2, "fingerprint": "5cec33d044392efa"}
    for path, tokenizer in ((a, BYTE_LEVEL), (b, hf)):
        path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer": tokenizer}))
    assert cli.main(["compare", f"{a}:off", f"{b}:off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron-ext: error: {a}:off and {b}:off were made with different tokenizers (A: "
                   "byte-level vs B: huggingface /t/bpe: library byte-level vs huggingface); compare runs made "
                   "with the same tokenizer"]
    # the same tokenizer stored elsewhere compares; a file from before ab recorded it is not checked
    b.write_text(json.dumps({**json.loads(b.read_text()), "tokenizer": {**BYTE_LEVEL, "path": None}}))
    assert cli.main(["compare", f"{a}:off", f"{b}:off"]) == 0
    c = ab_json(tmp_path / "c.json")
    assert cli.main(["compare", f"{a}:off", f"{c}:off"]) == 0


@pytest.mark.parametrize("edit", [
    lambda d: d["baseline"].update(outputs=[1]),
    lambda d: d.update(requests=[1, 2]),
    lambda d: d.update(requests=[{}]),
    lambda d: d["policies"][0].pop("eviction_policy"),
    lambda d: d.update(policies={"lru": 1}),
])
def test_edited_files_are_one_error_not_a_traceback(tmp_path, edit):
    path = ab_json(tmp_path / "a.json")
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(RecordedRunError, match=r"a.json: not as 'ab --json' writes it"):
        load_runs(path)


def test_top_n_recorded_in_one_file_only_is_refused(tmp_path):
    a, b = ab_json(tmp_path / "a.json"), ab_json(tmp_path / "b.json")
    data = json.loads(b.read_text())
    for run in [data["baseline"]] + [p["run"] for p in data["policies"]]:
        run["outputs"]["7"]["top_n_logprobs"] = [[["x", -1.0]]] * 3
    b.write_text(json.dumps(data))
    (x, y), *_ = pair_runs(str(a), str(b))
    with pytest.raises(RecordedRunError, match=r"only .*b.json:off recorded top-n log-probs"):
        compare_recorded(x, y)
