"""The shared helpers of the command-line refusal tests live in ``unit_tests/conftest.py``:
``nothing_runs`` stops every engine entry point, ``one_error_line`` reads exactly one error line."""

from __future__ import annotations

import sys

import pytest

from megatron_ext.harness import ab
from unit_tests.conftest import one_error_line


@pytest.mark.parametrize("name", ["build_model", "build_engine", "apply", "run_ab"])
def test_nothing_runs_fails_the_test_at_any_engine_entry_point(nothing_runs, name):
    with pytest.raises(pytest.fail.Exception, match="ran something before refusing the input"):
        getattr(ab, name)()


def test_one_error_line_returns_the_line(capsys):
    print("megatron-ext: error: --prompts p.txt: no such file", file=sys.stderr)
    assert one_error_line(capsys) == "megatron-ext: error: --prompts p.txt: no such file"


@pytest.mark.parametrize("stderr", ["megatron-ext: error: one\nTraceback (most recent call last):\n",
                                    "Traceback (most recent call last):\n", ""])
def test_one_error_line_refuses_a_traceback_a_second_line_or_none(capsys, stderr):
    sys.stderr.write(stderr)
    with pytest.raises(AssertionError):
        one_error_line(capsys)
