"""Fixtures shared by the functional tests: the installed release series and the torchrun helper.

* ``SERIES`` / ``mcore_series``: the release series (``"0.17"``, ``"0.18"``, ``"0.19"``) whose code
  the importable megatron-core has, decided by the code (:func:`code_series`), not by its version
  string: a Megatron-LM main tree says "0.20.0" and is keyed by the release it grew from; ``SERIES``
  for ``parametrize`` at collection time, the fixture inside tests.
* ``NEEDED_FIXES``: the patches the installed code needs (``status()`` unforced: every patch but
  the "not needed" ones; a refused patch counts, so a tree with unrecorded code fails the tests
  that depend on it instead of leaving them out).
* ``torchrun``: runs ``python -m megatron_ext ARGS`` on several CPU ranks (``torchrun``
  subprocesses, gloo) with a hard timeout (``MEGATRON_EXT_MULTIRANK_TIMEOUT_S``, default 420 s);
  on timeout the whole process group is killed and the test fails with the output.
* Tests marked ``multirank`` run only with ``MEGATRON_EXT_MULTIRANK=1``
  (``scripts/run_functional_tests.sh`` sets it); elsewhere they are skipped with that reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import megatron_ext.cpu_backend  # noqa: F401  before any apply(): how the Mamba mixer is imported
from megatron_ext import mcore

REPO = Path(__file__).resolve().parents[1]


def code_series() -> str:
    """The release series whose code the installed megatron-core has.

    For each recorded release (``megatron_ext/fingerprints.json``, trees without a commit), count
    the functions the patches check whose installed source has that release's fingerprint; the
    series of the release sharing the most (the newest on a tie). A PyPI release is its own series;
    a Megatron-LM main tree ("0.20.0" for every commit since 0.19 branched off) gets the series its
    code is nearest to (0.19 for 2a75ac12c5, measured values of 0.19 hold there unless a test says
    otherwise by what the code has, e.g. :data:`NEEDED_FIXES`).
    """
    from megatron_ext.fingerprints import known_trees
    from megatron_ext.patches import ALL_PATCHES

    releases = [tree.name for tree in known_trees().values() if not tree.commit]
    shared = dict.fromkeys(releases, 0)
    for patch in ALL_PATCHES:
        found = patch.match().found
        recorded = {**patch.fixed_fingerprints, **patch.faulty_fingerprints}
        for tree in releases:
            prints = recorded.get(tree, {})
            shared[tree] += sum(prints.get(name) == digest for name, digest in found.items())
    return mcore.release_series(max(releases, key=lambda tree: (shared[tree], releases.index(tree))))


def needed_fixes() -> frozenset[str]:
    """The patches ``status(force=False)`` does not call "not needed" here."""
    from megatron_ext import status
    from megatron_ext.patching import PatchState

    return frozenset(r.patch for r in status(force=False) if r.state is not PatchState.NOT_NEEDED)


SERIES = code_series()
NEEDED_FIXES = needed_fixes()
TIMEOUT_S = float(os.environ.get("MEGATRON_EXT_MULTIRANK_TIMEOUT_S", "420"))
MULTIRANK_OPT_IN = os.environ.get("MEGATRON_EXT_MULTIRANK") == "1"
_MULTIRANK_SKIP = pytest.mark.skipif(
    not MULTIRANK_OPT_IN,
    reason="multi-rank torchrun runs: scripts/run_functional_tests.sh (or MEGATRON_EXT_MULTIRANK=1)")


def pytest_collection_modifyitems(config, items) -> None:
    """Skip the ``multirank`` tests unless ``MEGATRON_EXT_MULTIRANK=1``."""
    for item in items:
        if item.get_closest_marker("multirank") is not None:
            item.add_marker(_MULTIRANK_SKIP)


@pytest.fixture(scope="session")
def mcore_series() -> str:
    """The series of the importable megatron-core, e.g. ``"0.19"``."""
    return SERIES


class Torchrun:
    """``megatron-ext`` commands on several CPU ranks, and the checks every multi-rank ``ab`` run must pass."""

    def run(self, nproc: int, args: list[str], label: str) -> tuple[int, str]:
        """``torchrun --standalone --nproc-per-node NPROC -m megatron_ext ARGS``; (exit code, output).

        Fails the test with the output tail if it runs past ``TIMEOUT_S`` (the ranks are killed)."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "megatron_ext", *args]
        env = {**os.environ, "MEGATRON_EXT_DIST_TIMEOUT_S": os.environ.get("MEGATRON_EXT_DIST_TIMEOUT_S", "120")}
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        # a SIGTERM to pytest (scripts/run_functional_tests.sh --timeout) must not orphan the ranks
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            output = _stop(proc)
            pytest.fail(f"torchrun {label}: no result after {TIMEOUT_S:.0f} s (hung rank?); "
                        f"output tail:\n{self.tail(output)}")
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:
                _stop(proc)
        print(f"torchrun {label}: exit {proc.returncode} after {time.monotonic() - started:.0f} s")
        return proc.returncode, output

    def ab(self, tmp_path: Path, tp: int, pp: int, case: str = "rl_rollouts",
           extra: tuple[str, ...] = ()) -> tuple[int, str, dict | None]:
        """Run ``ab`` on ``tp * pp`` CPU ranks; return (exit code, output, JSON or None)."""
        out = tmp_path / f"{case}-tp{tp}-pp{pp}.json"
        code, output = self.run(tp * pp, ["ab", "--case", case, "--no-progress", "--width", "160",
                                          "--tensor-model-parallel-size", str(tp),
                                          "--pipeline-model-parallel-size", str(pp),
                                          "--json", str(out), *extra],
                                label=f"TP={tp} PP={pp} {case}")
        return code, output, json.loads(out.read_text()) if out.exists() else None

    @staticmethod
    def tail(output: str, lines: int = 40) -> str:
        """The last ``lines`` lines of a torchrun's output, gloo's chatter left out."""
        keep = [line for line in output.splitlines() if not line.startswith("[Gloo]")]
        return "\n".join(keep[-lines:])

    def assert_clean(self, tp: int, pp: int, code: int, output: str, result: dict | None) -> None:
        """A multi-rank ``ab`` run passed: exit 0, bit-identical, audit-clean and identical on every rank."""
        assert result is not None, f"rank 0 wrote no JSON (exit {code}):\n{self.tail(output)}"
        assert result["failures"] == [], result["failures"]
        assert code == 0, self.tail(output)
        assert result["verdict"] == "pass"
        assert result["bit_identical"] is True
        assert result["kv_write_violations"] == 0 and result["refcount_violations"] == 0
        assert result["layout"] == {"world_size": tp * pp, "tensor_model_parallel_size": tp,
                                    "pipeline_model_parallel_size": pp}
        ranks = result["ranks"]
        assert [r["rank"] for r in ranks] == list(range(tp * pp))
        assert all(r["verdict"] == "pass" and r["batch_invariance_ok"] for r in ranks)
        assert all(r["kv_write_violations"] == 0 and r["refcount_violations"] == 0 for r in ranks)
        # TP ranks sample from the same gathered logits; PP stages get the last stage's tokens
        assert len({r["outputs_sha256"] for r in ranks}) == 1, "ranks disagree on generated tokens/log-probs"
        assert result["prefill_tokens_skipped"] > 0
        # rank 0's report only: gloo's and megatron-core's own output went to log files, and ranks
        # other than 0 printed nothing and left no log behind
        assert not [line for line in output.splitlines() if "[Gloo]" in line or "IS DEPRECATED" in line]
        assert output.rstrip().splitlines()[-1].startswith("PASS: ")


@pytest.fixture(scope="session")
def torchrun() -> Torchrun:
    """The torchrun helper (:class:`Torchrun`)."""
    return Torchrun()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _stop(proc: subprocess.Popen) -> str:
    """Stop torchrun: SIGTERM first (it then stops its ranks, each in its own session), SIGKILL
    to its process group if it is still there after 45 s. Returns what it printed."""
    try:
        proc.terminate()
        output, _ = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    return output or ""
