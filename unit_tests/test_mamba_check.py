"""The Mamba part of the batch-invariance self-check (issue 22, step 1): passes on megatron's real
Mamba kernels, fails naming the kernel when one is made batch-variant, runs only for hybrid models.

The kernels run under Triton's interpreter, which Triton reads at import, so the check runs in a
subprocess (``scripts/probes/mamba_check.py``, about 30 s of CPU time).
"""

from __future__ import annotations


import pytest
import torch

from megatron_ext.cpu_backend.mamba_check import CHECKED_CASES, MambaDtypes
from megatron_ext.harness.cases import ModelSpec
from megatron_ext.harness.hybrid import kernel_dtypes

from .conftest import run_triton_probe


#: What the check says it covered, before its verdict (fp32 run).
COVERED = ("Mamba kernels (prefill conv + chunk scan: a sequence alone vs first / middle / last of a packed "
           "batch, zero and random initial states; decode causal_conv1d_update + selective_state_update: "
           "each request alone vs in a batch of 3; {dtypes})")
FP32 = "float32 activations, float32 SSM states, float32 conv states"
PREFILL = [f"{kernel}: sequence {place} ({initial} initial state)"
           for kernel in ("causal_conv1d_varlen_fn", "mamba_chunk_scan_combined_varlen")
           for initial in ("zero", "random")
           for place in ("first of (24, 9)", "in the middle of (7, 24, 9)", "last of (9, 24)")]
DECODE = [f"{kernel}: request {row} of 3 (slot {slot})"
          for kernel in ("causal_conv1d_update", "selective_state_update")
          for row, slot in enumerate((3, 0, 4))]


@pytest.fixture(scope="module")
def probe() -> dict:
    return run_triton_probe("mamba_check")


def test_hybrid_backend_checks_the_mamba_kernels_and_they_are_batch_invariant(probe):
    matmuls, mamba = probe["hybrid"]["detail"].split("; ", 1)
    assert probe["hybrid"]["ok"] is True
    assert matmuls == probe["gpt"]["detail"]
    assert mamba == COVERED.format(dtypes=FP32) + " batch-invariant: 18 cases bit-identical"
    assert CHECKED_CASES == len(PREFILL) + len(DECODE) == 18


def test_bf16_activations_with_fp32_ssm_states_are_batch_invariant(probe):
    dtypes = "bfloat16 activations, float32 SSM states, bfloat16 conv states"
    assert probe["bf16"] == [True, COVERED.format(dtypes=dtypes) + " batch-invariant: 18 cases bit-identical"]


def test_gpt_backend_neither_runs_nor_imports_the_mamba_check(probe):
    assert probe["gpt"]["ok"] is True
    assert "Mamba" not in probe["gpt"]["detail"]
    assert probe["gpt"]["imported"] == []


def test_a_scan_that_mixes_in_a_neighbour_fails_the_check_naming_it(probe):
    scan = [case for case in PREFILL if case.startswith("mamba_chunk_scan_combined_varlen")]
    assert probe["scan_variant"] == [False, COVERED.format(dtypes=FP32) + " batch-variant: 6 of 18 cases differ: "
                                     + "; ".join(scan)]


def test_every_kernel_made_batch_variant_is_caught(probe):
    assert probe["all_variant"] == [False, COVERED.format(dtypes=FP32) + " batch-variant: 18 of 18 cases differ: "
                                    + "; ".join(PREFILL + DECODE)]


@pytest.mark.parametrize("fields, want", [
    ({}, None),
    ({"hybrid_layer_pattern": "M*M", "hidden_size": 32, "params_dtype": "fp32"},
     MambaDtypes(torch.float32, torch.float32, torch.float32)),
    ({"hybrid_layer_pattern": "M*M", "hidden_size": 32, "params_dtype": "bf16"},
     MambaDtypes(torch.bfloat16, torch.bfloat16, torch.bfloat16)),
    ({"hybrid_layer_pattern": "M*M", "hidden_size": 32, "params_dtype": "bf16", "mamba_ssm_states_dtype": "fp32"},
     MambaDtypes(torch.bfloat16, torch.float32, torch.bfloat16)),
    ({"hybrid_layer_pattern": "M*M", "hidden_size": 32, "params_dtype": "fp32", "mamba_conv_states_dtype": "bf16"},
     MambaDtypes(torch.float32, torch.float32, torch.bfloat16)),
])
def test_kernel_dtypes_are_the_runs(fields, want):
    """Unset state dtypes are the model's, as megatron-core's MambaInferenceStateConfig.from_model."""
    assert kernel_dtypes(ModelSpec(**fields)) == want
