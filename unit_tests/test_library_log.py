"""The library log of ``ab`` / ``soak`` / ``save-checkpoint`` (megatron-core's, torch's and gloo's
own output, gathered in ``$TMPDIR``): removed after a PASS unless ``--keep-log``, kept and named
after a FAIL or an error, an empty one never kept.

The engine is replaced by a stand-in that writes to file descriptors 1 and 2 (as gloo does from
C++) and returns a verdict or raises, so each outcome is exercised in milliseconds.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from megatron_ext import cli
from megatron_ext.console import settle_log
from megatron_ext.errors import MegatronExtError
from megatron_ext.harness import ab, checkpoint, engine, report, soak

LIBRARY_LINES = b"[Gloo] Rank 0 is connected to 0 peer ranks\nWARNING: megatron-core says something\n"


@pytest.fixture
def log_dir(tmp_path, monkeypatch):
    """Library logs go to ``tmp_path/<command>.log``; returns tmp_path."""
    monkeypatch.setattr(cli, "log_path", lambda command, rank: tmp_path / f"{command}.log")
    return tmp_path


@pytest.fixture
def engine_stand_in(monkeypatch):
    """``ab.run_ab`` writes :data:`LIBRARY_LINES` below Python, then returns a result whose exit
    code is ``outcome["code"]`` (or raises ``outcome["raise"]``); the report records its notes."""
    outcome = {"code": 0, "raise": None}
    notes = []

    def run_ab(case, **kwargs):
        first, second = LIBRARY_LINES.splitlines(keepends=True)
        os.write(1, first)  # both streams land in the one log, in order
        os.write(2, second)
        if outcome["raise"] is not None:
            raise outcome["raise"]
        return SimpleNamespace(exit_code=lambda: outcome["code"], ranks=[], as_json=dict)

    monkeypatch.setattr(ab, "run_ab", run_ab)
    monkeypatch.setattr(report, "print_report", lambda result, console, notes=(), **kw: outcome.setdefault("notes", list(notes)))
    monkeypatch.setattr(soak, "soak_summary", lambda result: {"requests": 1, "runs": {}})
    return outcome


def kept_line(path, why: str) -> str:
    return f"megatron-core / torch / gloo output: 2 lines in {path} ({why}; --verbose shows it inline)"


@pytest.mark.parametrize("command", [["ab"], ["soak", "--requests", "3"]])
def test_pass_removes_the_log_and_names_nothing(log_dir, engine_stand_in, command):
    assert cli.main([*command, "--no-progress"]) == 0
    assert list(log_dir.iterdir()) == []
    assert engine_stand_in["notes"] == []


@pytest.mark.parametrize("command", [["ab"], ["soak", "--requests", "3"]])
def test_keep_log_keeps_it_after_a_pass_and_names_it(log_dir, engine_stand_in, command):
    assert cli.main([*command, "--no-progress", "--keep-log"]) == 0
    log = log_dir / f"{command[0]}.log"
    assert log.read_bytes() == LIBRARY_LINES
    assert engine_stand_in["notes"][-1] == kept_line(log, "kept by --keep-log")


@pytest.mark.parametrize("command", [["ab"], ["soak", "--requests", "3"]])
def test_fail_keeps_the_log_and_names_it(log_dir, engine_stand_in, command):
    engine_stand_in["code"] = 1
    assert cli.main([*command, "--no-progress"]) == 1
    log = log_dir / f"{command[0]}.log"
    assert log.read_bytes() == LIBRARY_LINES
    assert engine_stand_in["notes"][-1] == kept_line(log, "kept: the run failed")


@pytest.mark.parametrize("command", [["ab"], ["soak", "--requests", "3"]])
def test_error_keeps_the_log_names_it_on_stdout_and_stderr_stays_one_line(log_dir, engine_stand_in, capsys,
                                                                            command):
    engine_stand_in["raise"] = MegatronExtError("--load /ckpt: architecture mismatch")
    assert cli.main([*command, "--no-progress"]) == 2
    log = log_dir / f"{command[0]}.log"
    assert log.read_bytes() == LIBRARY_LINES
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == kept_line(log, "kept: the command stopped with an error")
    assert out.err == "megatron-ext: error: --load /ckpt: architecture mismatch\n"


def test_ctrl_c_keeps_the_log(log_dir, engine_stand_in, capsys):
    engine_stand_in["raise"] = KeyboardInterrupt()
    assert cli.main(["ab", "--no-progress"]) == 130
    assert (log_dir / "ab.log").read_bytes() == LIBRARY_LINES
    assert "kept: the command stopped with an error" in capsys.readouterr().out


@pytest.fixture
def saving_stand_in(monkeypatch):
    """``save-checkpoint`` with the model build and the save replaced: the save writes
    :data:`LIBRARY_LINES` below Python and returns a path, or raises ``outcome["raise"]``."""
    outcome = {"raise": None}

    def save(model, directory, args, iteration):
        os.write(1, LIBRARY_LINES)
        if outcome["raise"] is not None:
            raise outcome["raise"]
        return f"{directory}/iter_{iteration:07d}"

    monkeypatch.setattr(engine, "build_model", lambda case: None)
    monkeypatch.setattr(engine, "ensure_model_parallel", lambda *a: None)
    monkeypatch.setattr(checkpoint, "save_megatron_lm_checkpoint", save)
    return outcome


@pytest.mark.parametrize("keep", [False, True])
def test_save_checkpoint_removes_the_log_unless_keep_log(log_dir, saving_stand_in, capsys, keep):
    directory = log_dir / "ckpt"
    assert cli.main(["save-checkpoint", str(directory)] + (["--keep-log"] if keep else [])) == 0
    log = log_dir / "save-checkpoint.log"
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"saved the model of case 'rl_rollouts' (seed 1234, bf16, TP=1 PP=1) to {directory}")
    if keep:
        assert log.read_bytes() == LIBRARY_LINES and out[0] == kept_line(log, "kept by --keep-log")
    else:
        assert not log.exists() and len(out) == 1


def test_save_checkpoint_error_keeps_the_log(log_dir, saving_stand_in, capsys):
    saving_stand_in["raise"] = checkpoint.CheckpointError("DIR is not empty; pass a new or empty directory")
    assert cli.main(["save-checkpoint", str(log_dir / "ckpt")]) == 2
    log = log_dir / "save-checkpoint.log"
    assert log.read_bytes() == LIBRARY_LINES
    assert capsys.readouterr().out.strip() == kept_line(log, "kept: the command stopped with an error")


def test_an_empty_log_is_never_kept_but_keep_log_keeps_it(tmp_path):
    for outcome in ("passed", "failed", "error"):
        path = tmp_path / f"{outcome}.log"
        path.write_bytes(b"")
        assert settle_log(path, outcome) is None and not path.exists()
    path.write_bytes(b"")
    assert settle_log(path, "passed", keep=True) == (
        f"megatron-core / torch / gloo output: 0 lines in {path} (kept by --keep-log; --verbose shows it inline)")
    assert path.exists()
    assert settle_log(None, "failed") is None  # --verbose: nothing was diverted


def test_verbose_writes_no_log(log_dir, engine_stand_in, capfd):
    assert cli.main(["ab", "--no-progress", "--verbose"]) == 0
    assert list(log_dir.iterdir()) == []
    assert "[Gloo] Rank 0 is connected" in capfd.readouterr().out
