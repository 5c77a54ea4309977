"""Fault H10 (issue 33): megatron's Mamba decode kernel stores its state into ``x[0, 0, 0, 0]``.

Released ``selective_state_update`` (0.17.0 to 0.19.2) passes ``x`` as the intermediate-state
buffer when none is given, with zero strides, and every kernel program stores its state tile
there. ``scripts/probes/mamba_decode.py`` runs it (Triton's interpreter, in a subprocess: about
10 s) for one decode step as ``MambaMixer`` calls it, with the runtime patches applied and then
with the released code: without a buffer ``x`` must keep its bits (fails unpatched on every
release: element ``[0, 0, 0, 0]`` changes), and output, SSM state and a given buffer must be the
released call's bits.
"""

from __future__ import annotations

import inspect

import pytest

from megatron_ext.patches.mamba_decode_no_dummy import (INT_STATE_ARG, INT_STRIDES, KERNEL, LAUNCHER, X_ARG,
                                                        passes_dummy_buffer)

from .conftest import SOURCE_PATCHED, UNPATCHED, run_triton_probe

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run


@pytest.fixture(scope="module")
def probe() -> dict:
    """The probe's JSON (runtime patches applied unless ``MEGATRON_EXT_TEST_UNPATCHED=1``)."""
    return run_triton_probe("mamba_decode", "unpatched" if UNPATCHED else "patched")


def test_a_decode_step_without_a_buffer_leaves_x_unchanged(probe):
    plain = probe["plain"]
    assert plain["x_changed"] == []
    assert probe["patch"] == ("not needed" if SOURCE_PATCHED else "applied")
    assert probe["kernel_wrapped"] is not SOURCE_PATCHED
    # the released call changes x: its first element becomes the last state element stored
    assert (plain["released_x_changed"], plain["released_x0_is_last_state"]) == (
        ([], False) if SOURCE_PATCHED else ([[0, 0, 0, 0]], True))


def test_outputs_states_and_a_given_buffer_are_the_released_bits(probe):
    same = {"out": True, "state": True, "buffer": True}
    assert probe["plain"]["same_as_released"] == same
    buffer = probe["buffer"]
    assert (buffer["same_as_released"], buffer["holds_the_new_states"]) == (same, True)
    assert buffer["x_changed"] == buffer["released_x_changed"] == []


def test_the_launch_wrapper_reads_the_kernels_own_arguments():
    kernel = KERNEL.original()
    while not inspect.isfunction(kernel):  # Triton's heuristics / jit layers
        kernel = kernel.fn
    names = list(inspect.signature(kernel).parameters)
    assert (names[X_ARG], names[INT_STATE_ARG]) == ("x_ptr", "int_state_ptr")
    assert names[INT_STRIDES] == ["stride_int_batch", "stride_int_seq", "stride_int_head", "stride_int_dim",
                                  "stride_int_dstate"]


def test_the_code_probe_tells_released_from_source_patched_launcher():
    has_fault, evidence = passes_dummy_buffer(LAUNCHER.original())
    assert (has_fault, "#6598" in evidence) == (not SOURCE_PATCHED, SOURCE_PATCHED), evidence
