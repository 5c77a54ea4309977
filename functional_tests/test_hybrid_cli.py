"""``megatron-ext ab`` on a hybrid case from a plain shell: no ``TRITON_INTERPRET`` /
``MAMBA_DETERMINISTIC`` in the environment (the command sets them before Triton is imported), the
report read from a file (stdout and stderr together), its batch-invariance self-check covering
megatron's Mamba kernels in the case's dtypes, and the bf16 Mamba-state rule (fault H2) said in the
report and in the verdict.

One ``ab`` of ``hybrid_tiny`` as a bf16 model (three engine runs, 40-240 s on one busy core); the
fp32 ``hybrid_tiny`` passing, with its fp32 self-check line, is ``test_hybrid.py``'s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HYBRID_TINY = REPO / "functional_tests" / "cases" / "hybrid_tiny.yaml"

#: The variables the command must set itself (and the re-exec marker, so none is inherited).
STRIPPED = ("TRITON_INTERPRET", "MAMBA_DETERMINISTIC", "MEGATRON_EXT_TRITON_REEXEC")


def run_logged(tmp_path: Path, *args: str) -> tuple[int, str]:
    """``python -m megatron_ext ARGS`` with stdout and stderr into one file, the Triton variables
    removed from its environment."""
    log = tmp_path / "out.txt"
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED and not k.startswith("MEGATRON_EXT_")}
    env["TMPDIR"] = str(tmp_path)  # the library log lands here
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "megatron_ext", *args], stdout=out,
                              stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=900)
    return done.returncode, log.read_text()


def assert_reads_cleanly(text: str) -> list[str]:
    lines = text.splitlines()
    assert "\r" not in text and "\x1b" not in text, "progress frames or terminal escapes in a log"
    assert not any(line.startswith("Traceback") for line in lines), text[-3000:]
    return lines


def self_check_line(lines: list[str]) -> str:
    """The report's batch-invariance line: passed, and covering megatron's Mamba kernels too."""
    [line] = [line for line in lines if line.startswith("batch-invariance self-check: ")]
    assert line.startswith("batch-invariance self-check: ok (batch-invariant with the mode on: "), line
    assert "; Mamba kernels (prefill conv + chunk scan: " in line, line
    return line


@pytest.mark.slow
@pytest.mark.release_independent
def test_ab_bf16_hybrid_with_bf16_mamba_states_warns_and_names_the_fault(tmp_path):
    """hybrid_tiny as a bf16 model with megatron-core's default Mamba state dtype (the model's):
    r1 restores r0's bf16 snapshot at token 48 and differs from caching off in its log-probs (every
    release 0.17.1-0.19.2); the report warns before the tables and the verdict names fault H2. Run
    without the Triton variables: the self-check covering the Mamba kernels shows the command set them."""
    text = HYBRID_TINY.read_text().replace("params_dtype: fp32", "params_dtype: bf16")
    text = re.sub(r",\s*mamba_ssm_states_dtype: fp32", "", text)
    assert "params_dtype: bf16" in text and "mamba_ssm_states_dtype" not in text
    case = tmp_path / "hybrid_tiny_bf16.yaml"
    case.write_text(text)
    code, out = run_logged(tmp_path, "ab", "--case", str(case), "--no-progress")
    lines = assert_reads_cleanly(out)
    assert code == 1, out[-3000:]
    warnings = [line for line in lines if line.startswith("warning:")]
    assert warnings == ["warning: Mamba states in bf16 (mamba_ssm_states_dtype unset: the model's dtype, "
                        "bf16) with prefix caching: requests that restore a cached Mamba state may differ "
                        "from caching off (fault H2, not patched); set mamba_ssm_states_dtype: fp32"]
    assert self_check_line(lines).endswith(  # the Mamba kernels checked in the run's dtypes
        "; bfloat16 activations, bfloat16 SSM states, bfloat16 conv states) batch-invariant: 18 cases bit-identical)")
    verdict = lines[lines.index("FAIL:"):]
    assert verdict[1:3] == ["  - ref_zero: 1 requests differ with caching on vs off: r1.s0",
                            "  - lru: 1 requests differ with caching on vs off: r1.s0"]
    assert verdict[-1].startswith("  - fault H2 (not patched): hybrid (Mamba) models with prefix caching "
                                  "need fp32 Mamba states")
