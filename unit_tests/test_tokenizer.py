"""Tokenizers through megatron-core's own stack: the default byte-level tokenizer, the user's
tokenizer (``ab --tokenizer``), and the refusals (one line, exit 2, before anything runs)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from megatron_ext import cli, mcore
from unit_tests.conftest import one_error_line
from megatron_ext.harness.cases import load_case, plan_requests, shipped_cases
from megatron_ext.harness.tokenizer import TokenizerError, check_vocab_fits, default_tokenizer, load_tokenizer
from unit_tests.tokenizer_factory import save_hf, train_bpe

PROMPT = "What is a KV block?"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A BPE tokenizer of 200 IDs trained here, saved as a Hugging Face directory (no metadata)."""
    return save_hf(train_bpe(200), tmp_path_factory.mktemp("tok") / "bpe200")


def test_default_is_megatron_cores_byte_level_tokenizer_as_the_cases_were_written_for():
    tokenizer = default_tokenizer()
    byte_level = mcore.import_module("megatron.core.tokenizers.text.libraries.bytelevel_tokenizer")
    assert isinstance(tokenizer.mcore_tokenizer._tokenizer, byte_level.ByteLevelTokenizer)
    assert (tokenizer.library, tokenizer.vocab_size, tokenizer.eod) == ("byte-level", 257, 256)
    assert tokenizer.as_json() == {"library": "byte-level", "path": None, "vocab_size": 257, "eod": 256,
                                   "fingerprint": "b8a4b1d26c7a1182"}
    # megatron-ext's former ByteTokenizer: token ID = UTF-8 byte; detokenize drops IDs outside
    # 0-255 (megatron-core's raises on 256) and replaces bad UTF-8 without stripping
    assert tokenizer.tokenize("héllo ") == [104, 195, 169, 108, 108, 111, 32]
    assert tokenizer.detokenize([104, 195, 169, 256, 300, 32, 32]) == "hé  "
    assert tokenizer.detokenize([0xC3]) == "\ufffd"


@pytest.mark.parametrize("name", shipped_cases())
def test_shipped_prompts_plan_to_the_same_token_ids_as_before(name):
    case = load_case(name)
    planned = plan_requests(case, default_tokenizer())
    texts = [spec.prefix + text for spec in case.requests
             for text in (spec.conversation and [
                 "".join(spec.conversation[:2 * k + 1]) for k in range((len(spec.conversation) + 1) // 2)]
                 or [spec.prompt]) for _ in range(spec.samples)]
    assert sorted(tuple(p.prompt_tokens) for p in planned) == sorted(tuple(t.encode("utf-8")) for t in texts)


def test_hugging_face_tokenizer_loads_through_megatron_core_and_writes_nothing(hf_dir):
    from tokenizers import Tokenizer

    before = sorted(os.listdir(hf_dir))
    tokenizer = load_tokenizer(str(hf_dir), "huggingface")
    assert sorted(os.listdir(hf_dir)) == before  # the library came as an in-memory metadata dict
    text_tokenizer = mcore.import_module("megatron.core.tokenizers.text.text_tokenizer")
    assert isinstance(tokenizer.mcore_tokenizer, text_tokenizer.MegatronTokenizerText)
    assert (tokenizer.library, tokenizer.vocab_size, tokenizer.eod) == ("huggingface", 200, 2)
    ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(PROMPT).ids
    assert tokenizer.tokenize(PROMPT) == ids == [64, 77, 48, 78, 166]
    # IDs beyond its vocabulary (a model's padded vocabulary) are dropped, not raised on
    assert tokenizer.detokenize(ids + [2, 200, 256]) == PROMPT + "</s>"


def test_metadata_file_names_the_library(hf_dir, tmp_path):
    tokenizers = mcore.import_module("megatron.core.tokenizers")
    directory = save_hf(train_bpe(200), tmp_path / "with-metadata")
    tokenizers.MegatronTokenizer.write_metadata(str(directory), "huggingface", model_type="gpt")
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.as_json() == load_tokenizer(str(hf_dir), "huggingface").as_json() | {"path": str(directory)}


def test_vocabulary_larger_than_the_model_is_refused(tmp_path):
    big = load_tokenizer(str(save_hf(train_bpe(300, byte_level=True), tmp_path / "bpe300")), "huggingface")
    assert big.vocab_size == 300
    with pytest.raises(TokenizerError, match=r"has 300 token IDs but the model's vocab_size is 257 \(case x\)"):
        check_vocab_fits(big, 257, "case x")
    check_vocab_fits(big, 300, "case x")


def test_cli_vocabulary_larger_than_the_model_exits_2(tmp_path, nothing_runs, capsys):
    directory = save_hf(train_bpe(300, byte_level=True), tmp_path / "bpe300")
    assert cli.main(["ab", "--tokenizer", str(directory), "--tokenizer-library", "huggingface"]) == 2
    assert one_error_line(capsys) == (
        f"megatron-ext: error: tokenizer {directory} has 300 token IDs but the model's vocab_size is 257 "
        "(case rl_rollouts); use a model with vocab_size >= 300")


def test_cli_missing_path_exits_2(tmp_path, nothing_runs, capsys):
    assert cli.main(["ab", "--tokenizer", str(tmp_path / "nope")]) == 2
    assert one_error_line(capsys) == f"megatron-ext: error: --tokenizer {tmp_path / 'nope'}: no such file or directory"


def test_cli_directory_without_metadata_exits_2(hf_dir, nothing_runs, capsys):
    assert cli.main(["ab", "--tokenizer", str(hf_dir)]) == 2
    assert one_error_line(capsys) == (
        f"megatron-ext: error: --tokenizer {hf_dir}: no tokenizer_metadata.json in {hf_dir}; pass "
        "--tokenizer-library (one of huggingface, sentencepiece, tiktoken, megatron, byte-level, null-text), "
        "or write it with megatron-core's MegatronTokenizer.write_metadata")


def test_cli_unknown_library_in_metadata_exits_2(tmp_path, nothing_runs, capsys):
    (tmp_path / "tokenizer_metadata.json").write_text(json.dumps({"library": "multimodal"}))
    assert cli.main(["ab", "--tokenizer", str(tmp_path)]) == 2
    assert one_error_line(capsys) == (
        f"megatron-ext: error: --tokenizer {tmp_path}: library 'multimodal' is not one ab can use; use one "
        "of huggingface, sentencepiece, tiktoken, megatron, byte-level, null-text")


def test_cli_missing_transformers_names_the_extra(hf_dir, nothing_runs, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    assert cli.main(["ab", "--tokenizer", str(hf_dir), "--tokenizer-library", "huggingface"]) == 2
    assert one_error_line(capsys) == (
        f"megatron-ext: error: --tokenizer {hf_dir}: huggingface tokenizers need the Python package "
        "'transformers', which is not installed; pip install 'megatron-ext[hf]'")


def test_cli_library_megatron_core_cannot_load_exits_2(tmp_path, nothing_runs, capsys):
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert cli.main(["ab", "--tokenizer", str(tmp_path), "--tokenizer-library", "huggingface"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"megatron-ext: error: --tokenizer {tmp_path}: megatron-core could not load it "
                           "as a huggingface tokenizer (")


def test_cli_library_without_tokenizer_exits_2(nothing_runs, capsys):
    assert cli.main(["ab", "--tokenizer-library", "huggingface"]) == 2
    assert one_error_line(capsys) == ("megatron-ext: error: --tokenizer-library names the library of "
                                      "--tokenizer PATH; pass --tokenizer too")


# ------------------------------------------------------------------------ soak --tokenizer


@pytest.fixture
def soak_engine(monkeypatch):
    """``run_ab`` for soak replaced: records the case and tokenizer it was given, returns a PASS."""
    from types import SimpleNamespace

    from megatron_ext.harness import ab, report, soak

    seen = {}

    def run_ab(case, **kwargs):
        seen.update(case=case, tokenizer=kwargs.get("tokenizer"))
        return SimpleNamespace(exit_code=lambda: 0, as_json=dict)

    monkeypatch.setattr(ab, "run_ab", run_ab)
    monkeypatch.setattr(report, "print_report", lambda *a, **k: None)
    monkeypatch.setattr(soak, "soak_summary", lambda result: {"requests": 3, "runs": {}})
    return seen


def test_soak_tokenizer_is_passed_to_the_runs(hf_dir, soak_engine, capsys):
    assert cli.main(["soak", "--requests", "3", "--no-progress", "--tokenizer", str(hf_dir),
                     "--tokenizer-library", "huggingface"]) == 0
    tokenizer = soak_engine["tokenizer"]
    assert (tokenizer.library, tokenizer.path, tokenizer.vocab_size) == ("huggingface", str(hf_dir), 200)
    assert soak_engine["case"].model.vocab_size == 257  # 200 IDs fit the soak model
    assert "vocab_size" not in capsys.readouterr().out


def test_soak_model_grows_to_a_larger_tokenizer_and_says_so(tmp_path, soak_engine, capsys):
    directory = save_hf(train_bpe(300, byte_level=True), tmp_path / "bpe300")
    dumped = tmp_path / "soak.yaml"
    assert cli.main(["soak", "--requests", "3", "--no-progress", "--tokenizer", str(directory),
                     "--tokenizer-library", "huggingface", "--dump-case", str(dumped)]) == 0
    assert soak_engine["case"].model.vocab_size == 300
    assert capsys.readouterr().out.splitlines()[0] == (
        f"soak: model vocab_size 257 -> 300 to fit the token IDs of --tokenizer {directory}")
    assert load_case(str(dumped)).model.vocab_size == 300  # 'ab --case soak.yaml --tokenizer' reruns it
    planned = plan_requests(soak_engine["case"], soak_engine["tokenizer"])  # the prompts tokenize with it
    assert len(planned) == 3 and all(max(r.prompt_tokens) < 300 for r in planned)


def test_soak_bad_tokenizer_exits_2_before_running(tmp_path, nothing_runs, capsys):
    assert cli.main(["soak", "--requests", "3", "--tokenizer", str(tmp_path / "nope")]) == 2
    assert one_error_line(capsys) == f"megatron-ext: error: --tokenizer {tmp_path / 'nope'}: no such file or directory"
    assert cli.main(["soak", "--requests", "3", "--tokenizer-library", "huggingface"]) == 2
    assert one_error_line(capsys) == ("megatron-ext: error: --tokenizer-library names the library of "
                                      "--tokenizer PATH; pass --tokenizer too")
