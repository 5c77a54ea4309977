"""Fault H7 (issue 22): a Mamba prefill slice shorter than d_conv loses its conv history.

The released ``MambaMixer._ssm_prefill`` (0.17.0 to 0.19.2) writes the conv state after a slice of
``L < d_conv`` tokens as ``[0, ..., 0, x_1 .. x_L]``. Two ways to such a slice, each compared bit
for bit with the same prompt prefilled at once with caching off (``scripts/probes/hybrid_state.py``
runs megatron-core's engine and Mamba kernels in a subprocess under Triton's interpreter):

* a restored mid-prompt Mamba snapshot (token 32) followed by 2 prompt tokens (fails unpatched on
  0.19.x: conv columns 0-1 differ; on 0.17.x / 0.18.x unpatched nothing is restored, fault H4);
* chunked prefill whose last chunk is 2 tokens (fails unpatched on every release);
* the same for a block-aligned prompt, whose end-of-prompt Mamba snapshot is committed from the
  live state after the step: 0.19's snapshot holds the reference conv state (fails unpatched:
  columns 0-1 differ); 0.17 / 0.18 commit none for a prompt prefilled in chunks.

The SSM state is exact either way (0.17's unpatched chunked SSM differs too: fault H3).
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from megatron_ext.patches.mamba_conv_carry import carry_conv_states, prefill_target, writes_slice_only_conv_state

from .conftest import SOURCE_PATCHED, UNPATCHED, run_triton_probe

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run


@pytest.fixture(scope="module")
def probe() -> dict:
    """The probe's JSON (runtime patches applied unless ``MEGATRON_EXT_TEST_UNPATCHED=1``).
    About 50 s of CPU time."""
    return run_triton_probe("hybrid_state", "unpatched" if UNPATCHED else "patched")


EXACT = {"conv_equal": True, "ssm_equal": True, "conv_columns_differing": [[], []]}


def test_restored_mid_prompt_snapshot_then_two_tokens_gives_the_reference_states(probe):
    restore = probe["restore"]
    assert [ok for _, ok in restore["restores"]] == [True], restore  # r0's state at token 32
    assert {k: restore[k] for k in EXACT} == EXACT, restore


def test_two_token_last_prefill_chunk_gives_the_reference_states(probe):
    chunked = probe["chunked"]
    assert {k: chunked[k] for k in EXACT} == EXACT, chunked


#: The ``eos`` probe per release series: the prompt's prefill slices, whether the end-of-prompt
#: snapshot was committed, and its conv state against the reference (the patch corrects the live
#: state inside the forward pass, before the commit copies it).
EOS = {"0.17": {"slices": [15, 15, 2], "committed": False},
       "0.18": {"slices": [15, 15, 2], "committed": False},
       "0.19": {"slices": [15, 1, 14, 2], "committed": True, "conv_equal": True, "conv_columns_differing": [[]]},
       # Megatron-LM main ("0.20.0"): 2a75ac12c5 schedules and commits as 0.19 does
       "0.20": {"slices": [15, 1, 14, 2], "committed": True, "conv_equal": True, "conv_columns_differing": [[]]}}


def test_block_aligned_prompt_ending_in_a_two_token_slice_commits_the_reference_conv_state(probe, mcore_series):
    eos = probe["eos"]
    assert {k: eos[k] for k in EOS[mcore_series]} == EOS[mcore_series], eos


@pytest.mark.parametrize("lengths", [[0, 1, 2, 3, 4, 7], [2]])
def test_carry_conv_states_is_the_last_d_conv_inputs_of_history_and_slice(lengths):
    """Against the definition: the last d_conv columns of ``[previous | slice]``."""
    d_conv, dim = 4, 3
    generator = torch.Generator().manual_seed(0)
    previous = torch.randn(len(lengths), dim, d_conv, generator=generator)
    slices = [torch.randn(dim, n, generator=generator) for n in lengths]
    # what causal_conv1d_varlen_states writes: the slice's last d_conv tokens, zeros before them
    written = torch.stack([torch.cat([torch.zeros(dim, d_conv), s], dim=1)[:, -d_conv:] for s in slices])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    want = torch.stack([torch.cat([p, s], dim=1)[:, -d_conv:] for p, s in zip(previous, slices)])
    assert torch.equal(carry_conv_states(previous, written, cu_seqlens), want)


def fixed_upstream() -> bool:
    """Whether the installed prefill carries the conv state itself (Megatron-LM #6711, on main from
    2026-08-22: d98e8a64 has it, 2a75ac12c5 does not)."""
    return "causal_conv1d_varlen_carry_states" in inspect.getsource(prefill_target().original())


def test_the_code_probe_tells_released_from_source_patched_ssm_prefill():
    has_fault, evidence = writes_slice_only_conv_state(prefill_target().original())
    if fixed_upstream():
        assert (has_fault, "#6711" in evidence) == (False, True), evidence
    else:
        assert (has_fault, "_carry_conv_states" in evidence) == (not SOURCE_PATCHED, SOURCE_PATCHED), evidence


def test_apply_imports_the_mixer_the_cpu_backend_can_still_run():
    # mamba-conv-carry's check imports the mixer; with the CPU backend imported first it binds
    # mamba_ssm through the compiled-extension stand-ins (a plain import binds the MagicMock
    # fallbacks for good: HAVE_MAMBA_SSM False), which are gone again afterwards
    code = ("import megatron_ext.cpu_backend, megatron_ext, sys\n"
            "states = {r.patch: r.state.value for r in megatron_ext.apply()}\n"
            "mixer = sys.modules['megatron.core.ssm.mamba_mixer']\n"
            "print(states['mamba-conv-carry'], mixer.HAVE_MAMBA_SSM, 'selective_scan_cuda' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    state = "not needed" if SOURCE_PATCHED or fixed_upstream() else "applied"
    assert out.splitlines()[-1] == f"{state} True False"
