"""Bad input to the command line: one line naming the problem and the fix, exit 2, nothing run.

Each test stubs out megatron-ext's engine entry points so a refusal that came too late (after a
model or engine was built) fails the test.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from megatron_ext import cli
from megatron_ext.harness import ab
from unit_tests.conftest import one_error_line


@pytest.mark.parametrize("command", [["ab", "--json"], ["ab", "--plot"], ["soak", "--requests", "5", "--json"],
                                     ["soak", "--requests", "5", "--dump-case"]])
def test_output_path_that_is_a_directory_exits_2_before_running(tmp_path, nothing_runs, capsys, command):
    assert cli.main([*command, str(tmp_path), "--no-progress"]) == 2
    assert one_error_line(capsys) == f"megatron-ext: error: {command[-1]} {tmp_path} is a directory; pass a file path"


def test_plot_without_matplotlib_exits_2_before_running(tmp_path, nothing_runs, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert cli.main(["ab", "--plot", str(tmp_path / "d.png"), "--no-progress"]) == 2
    assert "--plot needs matplotlib, which is not installed; pip install 'megatron-ext[plot]'" in one_error_line(capsys)


def test_device_cuda_without_cuda_exits_2_before_building(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ab, "build_model", lambda *a, **k: pytest.fail("built a model without a device"))
    assert cli.main(["ab", "--device", "cuda", "--no-progress", "--verbose"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("megatron-ext: error: --device cuda: no CUDA device is available here")
    assert line.endswith("use --device cpu, or run on a machine with a GPU")


def test_case_file_that_is_not_yaml_is_one_line(tmp_path, nothing_runs, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nrequests: [\n")
    assert cli.main(["ab", "--case", str(path), "--no-progress"]) == 2
    assert one_error_line(capsys) == (
        f"megatron-ext: error: {path}: not valid YAML: expected the node content, but found "
        "'<stream end>' at line 3, column 1; fix the file (a case is a YAML mapping, see the shipped cases)")


@pytest.mark.parametrize("flag", ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"])
def test_parallel_size_below_one_is_an_argument_error(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["ab", flag, "0"])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["ab", "--width", "5"], "argument --width: must be >= 40 columns (or left out), got 5"),
    (["compare", "a.json", "b.json", "--width", "0"], "argument --width: must be >= 40 columns (or left out), got 0"),
])
def test_width_below_forty_is_an_argument_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, line", [
    (["soak", "--mla", "--moe"], "megatron-ext soak: error: argument --moe: not allowed with argument --mla"),
    (["soak", "--policy", "bogus"],
     "megatron-ext soak: error: argument --policy: invalid choice: 'bogus' (choose from 'ref_zero', 'lru')"),
    (["ab", "--no-such-option"], "megatron-ext: error: unrecognized arguments: --no-such-option"),
    (["frobnicate"], "megatron-ext: error: argument command: invalid choice: 'frobnicate' (choose from "
                     "'status', 'ab', 'save-checkpoint', 'soak', 'compare', 'patch-source')"),
])
def test_usage_error_is_one_line_naming_where_the_options_are(args, line, capsys):
    """argparse's errors: one line (no usage block above it), the problem and the command's --help, exit 2."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 2
    prog = line.split(": error:")[0]
    assert capsys.readouterr().err.splitlines() == [f"{line}; `{prog} --help` lists the options"]


def test_soak_rope_type_without_mla_exits_2_before_running(monkeypatch, capsys):
    monkeypatch.setattr(ab, "build_model", lambda *a, **k: pytest.fail("built a model for a refused soak"))
    assert cli.main(["soak", "--requests", "5", "--rope-type", "yarn", "--no-progress"]) == 2
    assert one_error_line(capsys) == "megatron-ext: error: soak: --rope-type yarn applies to --mla only, and is rope or yarn"


def test_plot_in_a_format_matplotlib_cannot_write_exits_2_before_running(tmp_path, nothing_runs, capsys):
    assert cli.main(["ab", "--plot", str(tmp_path / "delta.txt"), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"megatron-ext: error: --plot {tmp_path / 'delta.txt'}: matplotlib writes ")
    assert "png" in line and line.endswith("not 'txt'; name the file e.g. delta.png")


def test_top_n_above_the_vocabulary_exits_2_before_building(monkeypatch, capsys, tmp_path):
    for name in ("build_model", "build_engine", "apply"):
        monkeypatch.setattr(ab, name, lambda *a, **k: pytest.fail("built something before refusing"))
    assert cli.main(["ab", "--top-n-logprobs", "100000", "--no-progress", "--verbose"]) == 2
    assert one_error_line(capsys) == ("megatron-ext: error: case 'rl_rollouts': top-n log-probs 100000 exceed the "
                                      "model's vocabulary of 257 tokens; ask for at most that many")
    case = tmp_path / "topn.yaml"  # the same from a case file
    case.write_text("name: topn\nsampling: {top_n_logprobs: 5000}\nrequests: [{prompt: a}]\n")
    assert cli.main(["ab", "--case", str(case), "--no-progress", "--verbose"]) == 2
    assert "case 'topn': top-n log-probs 5000 exceed the model's vocabulary of 257" in one_error_line(capsys)


@pytest.mark.parametrize("value", ["abc", "inf", "1e300", "0"])
def test_dist_timeout_that_is_not_a_sane_number_exits_2(monkeypatch, capsys, value):
    monkeypatch.setenv("MEGATRON_EXT_DIST_TIMEOUT_S", value)
    monkeypatch.setattr(ab, "build_model", lambda *a, **k: pytest.fail("built a model"))
    assert cli.main(["ab", "--no-progress", "--verbose"]) == 2
    assert one_error_line(capsys) == (f"megatron-ext: error: MEGATRON_EXT_DIST_TIMEOUT_S='{value}' is not a number "
                                      "of seconds in (0, 604800]; set it to e.g. 120 or unset it")


def test_library_log_that_cannot_be_written_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "log_path", lambda command, rank: tmp_path / "missing" / f"{command}.log")
    monkeypatch.setattr(ab, "build_model", lambda *a, **k: pytest.fail("built a model"))
    before = len(os.listdir("/proc/self/fd"))
    assert cli.main(["ab", "--no-progress"]) == 2
    assert one_error_line(capsys).startswith(f"megatron-ext: error: cannot write the library log {tmp_path}/missing/")
    assert len(os.listdir("/proc/self/fd")) == before  # no file descriptor left open


def test_skip_naming_no_patch_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("MEGATRON_EXT_SKIP", "lru-resume-evictable,bogus")
    assert cli.main(["status"]) == 2
    assert one_error_line(capsys).startswith("megatron-ext: error: MEGATRON_EXT_SKIP names bogus, which is not a "
                                             "patch; patches: release-refcount, ")
