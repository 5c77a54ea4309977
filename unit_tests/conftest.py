"""Shared fixtures: the installed megatron-core release and the runtime patches under test.

``MEGATRON_EXT_TEST_SOURCE_PATCHED=1`` says the imported megatron-core carries the source
patches of ``patches/`` (the released code is then fixed already). Set ``MEGATRON_EXT_TEST_UNPATCHED=1`` to run the same tests against the released code without the
runtime patches: the fault tests then fail on the releases that have the faults, which is how the
issue notes count "fails unpatched, passes patched".

Helpers of the command-line refusal tests (``test_cli_errors.py``, ``test_tokenizer.py``, ...): the
:func:`nothing_runs` fixture and :func:`one_error_line` (import it: ``from unit_tests.conftest import
one_error_line``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import megatron_ext
import megatron_ext.cpu_backend  # noqa: F401  before any apply(): how the Mamba mixer is imported
from megatron_ext import mcore

warnings.filterwarnings("ignore", module="megatron")

UNPATCHED = os.environ.get("MEGATRON_EXT_TEST_UNPATCHED", "") == "1"
# Set by functional_tests/test_source_patches.py when the imported tree carries patches/.
SOURCE_PATCHED = os.environ.get("MEGATRON_EXT_TEST_SOURCE_PATCHED", "") == "1"

_REPO = Path(__file__).resolve().parents[1]


def run_triton_probe(name: str, *args: str) -> dict:
    """Run ``python scripts/probes/<name>.py ARGS`` under Triton's interpreter (which Triton reads at
    import, hence a fresh interpreter), with this checkout's ``megatron_ext`` first on the path, and
    return the JSON of its last ``PROBE `` line.

    Raises:
        AssertionError: the probe failed or printed no ``PROBE`` line (its output's tail attached).
    """
    path = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1", "MAMBA_DETERMINISTIC": "1"}
    proc = subprocess.run([sys.executable, "-W", "ignore", str(_REPO / "scripts" / "probes" / f"{name}.py"), *args],
                          cwd=_REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE "):])


@pytest.fixture(scope="session")
def mcore_version() -> str:
    return mcore.installed_version()


@pytest.fixture(scope="session")
def mcore_series(mcore_version: str) -> str:
    return mcore.release_series(mcore_version)


@pytest.fixture
def runtime_patches():
    """Apply megatron-ext's runtime patches for one test (unless running unpatched), then revert."""
    results = [] if UNPATCHED else megatron_ext.apply()
    yield results
    megatron_ext.revert()


@pytest.fixture(params=["in order", "reversed"])
def runtime_patches_either_order(request, monkeypatch):
    """The runtime patches applied in ALL_PATCHES order or reversed (none when unpatched): they
    must compose in any order. Reverted after the test."""
    from megatron_ext import api
    from megatron_ext.patches import ALL_PATCHES

    if request.param == "reversed":
        monkeypatch.setattr(api, "ALL_PATCHES", tuple(reversed(ALL_PATCHES)))
    yield [] if UNPATCHED else megatron_ext.apply()
    megatron_ext.revert()


@pytest.fixture
def nothing_runs(monkeypatch):
    """Make every engine entry point of ``ab`` fail the test: a refusal of bad input that came too
    late (after a model or engine was built, or the patches applied) then fails instead of passing."""
    from megatron_ext.harness import ab  # imports torch: only the tests that use the fixture pay

    for name in ("build_model", "build_engine", "apply", "run_ab"):
        monkeypatch.setattr(ab, name, lambda *a, **k: pytest.fail("ran something before refusing the input"))


def one_error_line(capsys) -> str:
    """The one line the command line printed on stderr, asserting there is exactly one and that it
    is megatron-ext's error line (``megatron-ext: error: ...``): bad input gets one line, no traceback."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("megatron-ext: error: ")
    return err[0]
