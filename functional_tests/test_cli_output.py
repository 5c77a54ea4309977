"""The report as read in a log: ``ab`` and ``soak`` with stdout and stderr sent to one file.

No progress-bar frames, no header or value cut to 80 columns, none of megatron-core's, torch's or
gloo's own output (it goes to a log file the report names), and the verdict on the last line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.release_independent

#: Column headers of the report's tables, each of which must appear whole on one line.
HEADERS = ("tokens equal", "log-probs equal", "first divergent step", "first divergent token",
           "max |Δ log-prob|", "prefill tokens skipped", "prefill tokens computed", "KV writes checked",
           "ref-count violations", "LRU violations", "cached blocks evicted (LRU)", "deregistered at ref 0")
LIBRARY_LOG = re.compile(r"^megatron-core / torch / gloo output: (\d+) lines in (\S+) \((kept by --keep-log|kept: the "
                         r"run failed|kept: the command stopped with an error); --verbose shows it inline\)$")


def run_logged(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run ``python -m megatron_ext ARGS`` with stdout and stderr into one file, as a CI log."""
    log = tmp_path / "out.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    env["TMPDIR"] = str(tmp_path)  # the library log lands here
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "megatron_ext", *args], stdout=out,
                              stderr=subprocess.STDOUT, env=env, timeout=600)
    return done.returncode, log.read_text()


def assert_reads_cleanly(text: str, verdict: str) -> list[str]:
    lines = text.splitlines()
    assert "\r" not in text, "progress-bar frames in a log"
    assert "…" not in text, "a header or value was cut"
    assert not any("[Gloo]" in line or "IS DEPRECATED" in line for line in lines)
    assert not any(line.startswith("Traceback") for line in lines)
    assert lines[-1].startswith(verdict), lines[-1]
    return lines


@pytest.mark.slow
def test_ab_report_in_a_log_reads_cleanly(tmp_path):
    code, text = run_logged(tmp_path, "ab", "--case", "shared_system_prompt", "--keep-log")
    assert code == 0, text
    lines = assert_reads_cleanly(text, "PASS: ")
    for header in HEADERS:
        assert any(header in line for line in lines), f"header {header!r} not whole on one line"
    # one line per finished run instead of progress frames, before the report
    assert lines[:3] == [line for line in lines[:3] if re.fullmatch(
        r"shared_system_prompt: (A: caching off|B: caching on, (ref_zero|lru)): \d+ engine steps, [\d.]+ s", line)]
    assert len(lines[:3]) == 3
    # the libraries' output went to the file the report names, gloo's connection lines included
    named = [LIBRARY_LOG.match(line) for line in lines if LIBRARY_LOG.match(line)]
    assert len(named) == 1 and lines[-2] == named[0].group(0) and named[0].group(3) == "kept by --keep-log"
    library_log = Path(named[0].group(2))
    assert library_log.parent == tmp_path
    held = library_log.read_text().splitlines()
    assert len(held) == int(named[0].group(1))
    assert any(line.startswith("[Gloo] Rank 0 is connected") for line in held)


@pytest.mark.slow
def test_soak_figures_come_before_the_verdict(tmp_path):
    code, text = run_logged(tmp_path, "soak", "--requests", "6", "--policy", "lru")
    assert code == 0, text
    lines = assert_reads_cleanly(text, "PASS: 6 requests bit-identical")
    figures = [line.split(":")[0] for line in lines if line.startswith("soak ")]
    assert figures == ["soak caching off", "soak lru"]
    # figures, then the verdict; a PASS leaves no library log behind and names none
    assert lines[-2].startswith("soak lru: 6 requests, ")
    assert not any(LIBRARY_LOG.match(line) for line in lines)
    assert not list(tmp_path.glob("megatron-ext-*.log"))


def test_verbose_keeps_library_output_inline(tmp_path):
    code, text = run_logged(tmp_path, "save-checkpoint", str(tmp_path / "ckpt"), "--case",
                            "shared_system_prompt", "--verbose")
    assert code == 0, text
    assert "[Gloo] Rank 0 is connected" in text
    assert not LIBRARY_LOG.search(text)
    assert not list(tmp_path.glob("megatron-ext-*.log"))
    assert text.splitlines()[-1].startswith("saved the model of case 'shared_system_prompt'")


def _started(tmp_path: Path) -> bool:
    # the library log exists from the command's start, before megatron-core is imported
    return bool(list(tmp_path.glob("megatron-ext-soak-*.log")))


def _first_run_done(tmp_path: Path) -> bool:
    return "A: caching off:" in (tmp_path / "out.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("when", [_started, _first_run_done], ids=["while importing", "between runs"])
def test_ctrl_c_exits_130_with_one_line(tmp_path, when):
    # while importing: megatron-core's bare `except:` around optional imports swallows a
    # KeyboardInterrupt raised there; the soak must stop at its first engine step all the same
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    env["TMPDIR"] = str(tmp_path)
    with (tmp_path / "out.txt").open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "megatron_ext", "soak", "--requests", "60"],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while not when(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process.poll() is None, "the soak ended before it could be interrupted"
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
    text = (tmp_path / "out.txt").read_text()
    assert code == 130, text
    assert text.splitlines()[-1] == "megatron-ext: soak interrupted (Ctrl-C)"
    assert "Traceback" not in text
    # a library log holding something is kept after the interruption and named before the last
    # line; an empty one is removed (whether megatron-core printed yet depends on the machine)
    lines = text.splitlines()
    named = LIBRARY_LOG.match(lines[-2]) if len(lines) > 1 else None
    if named:
        assert named.group(3) == "kept: the command stopped with an error", text
        assert Path(named.group(2)).is_file()
    else:
        assert not any(p.stat().st_size == 0 for p in tmp_path.glob("megatron-ext-soak-*.log"))

