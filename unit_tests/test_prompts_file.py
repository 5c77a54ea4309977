"""``ab --prompts FILE``: the user's prompts, JSON Lines or plain text, bad lines named."""

from __future__ import annotations

import pytest

from megatron_ext import cli
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.prompts import PromptFileError, prompts_case, read_prompts


def test_plain_text_one_prompt_per_line_blank_lines_skipped(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second, with {braces}  \n")
    prompts = read_prompts(path, samples=3, num_tokens_to_generate=5)
    assert [(n, s.prompt, s.samples, s.num_tokens_to_generate, s.arrival_step) for n, s in prompts] == [
        (1, "first prompt", 3, 5, 0), (3, "  second, with {braces}  ", 3, 5, 0)]


@pytest.mark.parametrize("inside", ["\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\v", "\r"])
def test_plain_text_lines_end_at_newline_only(tmp_path, inside):
    # str.splitlines() breaks at all of these (but \r only with universal newlines): they are part of the prompt
    path = tmp_path / "p.txt"
    path.write_bytes(f"one{inside}two\nthree\r\nfour".encode())
    prompts = read_prompts(path)
    assert [(n, s.prompt) for n, s in prompts] == [(1, f"one{inside}two"), (2, "three"), (3, "four")]


def test_jsonl_line_holding_an_unescaped_line_separator_is_one_line(tmp_path):
    path = tmp_path / "p.jsonl"
    # JSON allows U+2028, U+2029 and U+0085 raw inside strings (not \x1c: a control character)
    path.write_bytes('{"prompt": "a\u2028b"}\r\n{"prompt": "c\x85d\u2029", "samples": 2}\n'.encode())
    prompts = read_prompts(path)
    assert [(n, s.prompt, s.samples) for n, s in prompts] == [(1, "a\u2028b", 1), (2, "c\x85d\u2029", 2)]


@pytest.mark.parametrize("suffix, body", [(".txt", "first\r\nsecond\r\n"),
                                          (".jsonl", '{"prompt": "first"}\n{"prompt": "second"}\n')])
def test_utf8_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path, suffix, body):
    path = tmp_path / f"p{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert [(n, s.prompt) for n, s in read_prompts(path)] == [(1, "first"), (2, "second")]


def test_bad_utf8_after_a_byte_order_mark_names_the_file_offset(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbfab\xff\n")
    with pytest.raises(PromptFileError) as error:
        read_prompts(path)
    assert str(error.value) == f"--prompts {path}: not UTF-8 text (byte 5); save it as UTF-8"


def test_jsonl_lines_override_the_command_line_defaults(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "samples": 2, "num_tokens_to_generate": 4, "arrival_step": 7}\n')
    prompts = read_prompts(path, samples=3)
    assert [(n, s.prompt, s.samples, s.num_tokens_to_generate, s.arrival_step) for n, s in prompts] == [
        (1, "a", 3, 8, 0), (2, "b", 2, 4, 7)]


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "a", "temperature": 0.5}', "line 2: unknown key(s) temperature; a line may have prompt, samples, "
                                            "num_tokens_to_generate, arrival_step"),
    ('{"promt": "a"}', "line 2: unknown key(s) promt; a line may have prompt, samples"),
    ('{"samples": 2}', 'line 2: expected a JSON object with a "prompt"'),
    ('["a"]', 'line 2: expected a JSON object with a "prompt"'),
    ('{"prompt": "a",}', "line 2: not JSON (Expecting property name enclosed in double quotes)"),
    ('{"prompt": "a", "samples": 0}', "line 2: field 'samples': Input should be greater than or equal to 1"),
    ('{"prompt": 5}', "line 2: field 'prompt': Input should be a valid string"),
    ('{"prompt": ""}', "line 2: field '<top>': Value error, empty prompt"),
])
def test_bad_jsonl_line_is_refused_with_its_number(tmp_path, line, problem):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(PromptFileError) as error:
        read_prompts(path)
    assert str(error.value).startswith(f"{path}: {problem}")


def test_prompt_too_long_for_the_case_names_its_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("short\n" + "x" * 600 + "\n")
    with pytest.raises(PromptFileError, match=r"p.txt: line 2: prompt of 600 tokens \+ 8 generated = 608 exceeds "
                                              r"inference.max_sequence_length=256; .* \(in --case rl_rollouts\)"):
        prompts_case(load_case("rl_rollouts"), path)


def test_case_keeps_model_and_policies_takes_the_prompts(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("a\nb\n")
    base = load_case("lru_pressure")
    case = prompts_case(base, path, samples=2)
    assert case.name == "lru_pressure+mine.txt"
    assert (case.model, case.inference, case.prefix_caching_eviction_policies) == (
        base.model, base.inference, base.prefix_caching_eviction_policies)
    assert [(r.prompt, r.samples) for r in case.requests] == [("a", 2), ("b", 2)]
    assert case.expectations.min_blocks_matched == 0 and case.expectations.min_prefill_tokens_skipped == 0


@pytest.mark.parametrize("setup, args, message", [
    (None, ["--prompts", "{d}/missing.txt"], "--prompts {d}/missing.txt: no such file"),
    (None, ["--prompts", "{d}"], "--prompts {d} is a directory; pass a .jsonl or text file"),
    ("\n\n", ["--prompts", "{d}/p.txt"], "{d}/p.txt holds no prompt; write one prompt per line"),
    (b"\xff\xfe", ["--prompts", "{d}/p.txt"], "--prompts {d}/p.txt: not UTF-8 text (byte 0); save it as UTF-8"),
    (None, ["--samples", "2"], "--samples and --num-tokens-to-generate apply to --prompts FILE"),
])
def test_cli_bad_prompts_input_exits_2_with_one_line(tmp_path, capsys, monkeypatch, setup, args, message):
    from megatron_ext.harness import ab

    monkeypatch.setattr(ab, "run_ab", lambda *a, **k: pytest.fail("ran before refusing the input"))
    if isinstance(setup, bytes):
        (tmp_path / "p.txt").write_bytes(setup)
    elif setup is not None:
        (tmp_path / "p.txt").write_text(setup)
    assert cli.main(["ab", *[a.format(d=tmp_path) for a in args], "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-ext: error: " + message.format(d=tmp_path))
