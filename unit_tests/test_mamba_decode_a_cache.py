"""Fault H11: after a weight update, Mamba decode steps keep using the old ``A = -exp(A_log)``.

``scripts/probes/mamba_decode_a_cache.py`` (Triton's interpreter, in a subprocess: 2-3 min for the
two paths; marked ``slow``, an engine run end to end, so .ci/run runs it under the newest release,
and on its source-patched tree through ``functional_tests/test_source_patches.py``) runs two rounds of ``hybrid_tiny`` (greedy, 6 and 4 tokens, prefix caching off)
with a weight update between them, and compares round 2 with a fresh model holding the updated
weights on a fresh engine. The update paths: every weight ``.data.add_`` (``A_log`` +0.5) inside
``suspend()`` / ``resume()`` (a refit: only the resume signal tells), and written in place with
``.data.copy_`` and a new engine on the same model (the harness's restore: the new context's
signal). The probe also knows ``load_state_dict`` and ``A_log`` alone inside ``suspend()`` /
``resume()``; the stamp tests below cover ``load_state_dict``'s version bump on every tree. Patched (or source-patched, or 0.17,
which has no cache) round 2 is the fresh engine's bits; unpatched on 0.18, 0.19 and main every
decode step's log-prob differs (the first token, from prefill, does not): the round-2 tests and
the stamp test fail there.
``swap_model_weights`` itself is not run (it needs a refit plan between two models): the direct
tests below call it with a bad ``refit_method`` (it raises ``TypeError`` before copying anything,
which still counts as a swap) on a stand-in mixer.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_ext import mcore
from megatron_ext.patches import mamba_decode_a_cache as h11
from megatron_ext.patches.swap_hook import REFIT_MODULE, SWAP_HOOK

from .conftest import SOURCE_PATCHED, UNPATCHED, run_triton_probe

PATHS = ("add", "new_engine")


@pytest.fixture(scope="module")
def probe() -> dict:
    """The probe's JSON (runtime patches applied unless ``MEGATRON_EXT_TEST_UNPATCHED=1``)."""
    return run_triton_probe("mamba_decode_a_cache", "unpatched" if UNPATCHED else "patched", *PATHS)


def faulty_release() -> bool:
    """Whether the installed tree has the cache (0.18+) without a fix (not source-patched)."""
    return mcore.release_series(mcore.installed_version()) != "0.17" and not SOURCE_PATCHED


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_round_two_after_a_weight_update_is_a_fresh_engines_bits(probe, path):
    result = probe[path]
    assert result["generated"] == {"0": 6, "1": 4}
    # unpatched on 0.18+: {"0": [1, 2, 3, 4, 5], "1": [1, 2, 3]} (test below)
    assert (result["same"], result["decode_logprobs_differ"], result["max_abs_dlogprob"]) == (
        True, {"0": [], "1": []}, 0.0)


@pytest.mark.slow
@pytest.mark.skipif(not (UNPATCHED and faulty_release()), reason="the fault itself: released code of 0.18+")
def test_unpatched_every_decode_step_after_an_update_runs_the_old_a(probe):
    for path in PATHS:  # prefill computes A afresh: the first token agrees, every decode step ran the old A
        assert (probe[path]["same"], probe[path]["decode_logprobs_differ"]) == (
            False, {"0": [1, 2, 3, 4, 5], "1": [1, 2, 3]}), path
        assert probe[path]["max_abs_dlogprob"] > 1e-4, path


@pytest.mark.slow
def test_the_patch_is_applied_where_the_fault_is(probe):
    assert probe["patch"] == ("not applied" if UNPATCHED else "applied" if faulty_release() else "not needed")


class StubMixer(torch.nn.Module):
    """The attributes ``MambaMixer._get_decode_A_neg_exp`` reads, set as ``MambaMixer.__init__``
    sets them (4 heads, ``headdim`` 2, ``d_state`` 3), with the installed function as a method."""

    def __init__(self) -> None:
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.log(torch.arange(1.0, 5.0)))
        self._A_neg_exp_cache = torch.empty_like(self.A_log, dtype=torch.float32)
        self._A_neg_exp_cache_stale = True
        self.headdim, self.d_state = 2, 3

    def decode_a(self) -> torch.Tensor:
        with torch.inference_mode():
            return h11.DECODE_A.current()(self)


def expected_a(mixer: StubMixer) -> torch.Tensor:
    return -torch.exp(mixer.A_log.detach().float())


@pytest.mark.every_tree
@pytest.mark.skipif(SOURCE_PATCHED, reason="the runtime patch's stamp and refresh on a stand-in mixer")
@pytest.mark.skipif(not faulty_release(), reason="0.17 has no decode cache of A")
def test_the_decode_cache_follows_a_log_in_place_updates(runtime_patches):
    mixer = StubMixer().eval()
    storage = mixer._A_neg_exp_cache.data_ptr()
    first = mixer.decode_a()
    assert first.shape == (4, 2, 3) and torch.equal(first[:, 0, 0], expected_a(mixer))
    with torch.no_grad():  # load_state_dict's way: bumps A_log._version
        mixer.A_log.copy_(mixer.A_log + 0.5)
    assert torch.equal(mixer.decode_a()[:, 0, 0], expected_a(mixer))
    mixer.A_log.data.add_(0.25)  # a refit's way: no version bump, only a signal tells
    h11.refresh_all()
    assert torch.equal(mixer._A_neg_exp_cache, expected_a(mixer))  # refilled eagerly, before any decode
    mixer.A_log.data.add_(0.125)
    refit = importlib.import_module(REFIT_MODULE)
    with pytest.raises(TypeError):  # fails before copying anything: still a swap
        refit.swap_model_weights(None, None, refit_method=object())
    assert torch.equal(mixer._A_neg_exp_cache, expected_a(mixer))
    assert torch.equal(mixer.decode_a()[:, 0, 0], expected_a(mixer))
    assert mixer._A_neg_exp_cache.data_ptr() == storage  # CUDA graphs replay this address


@pytest.mark.every_tree
@pytest.mark.skipif(UNPATCHED, reason="megatron-ext's stamp: the released code has none")
@pytest.mark.skipif(SOURCE_PATCHED or not faulty_release(), reason="the runtime patch's stamp")
def test_a_training_mixer_is_left_to_the_released_code(runtime_patches):
    mixer = StubMixer().eval()
    mixer.decode_a()
    stamp = mixer.__dict__[h11.STAMP_ATTR]
    mixer.train()
    mixer.A_log.data.add_(1.0)
    h11.refresh_all()  # not refilled while training: the released code computes A afresh there
    assert mixer.__dict__[h11.STAMP_ATTR] == stamp
    assert not torch.equal(mixer._A_neg_exp_cache, expected_a(mixer))
    mixer.eval()
    assert torch.equal(mixer.decode_a()[:, 0, 0], expected_a(mixer))


@pytest.mark.every_tree
@pytest.mark.skipif(SOURCE_PATCHED, reason="megatron-ext's wrapper of swap_model_weights")
def test_the_swap_hook_serves_each_owner_until_it_leaves():
    refit = importlib.import_module(REFIT_MODULE)
    released = refit.swap_model_weights
    seen = []
    SWAP_HOOK.install("first", lambda: seen.append("first"))
    SWAP_HOOK.install("second", lambda: seen.append("second"))
    try:
        with pytest.raises(TypeError):
            refit.swap_model_weights(None, None, refit_method=object())
        assert seen == ["first", "second"]
        SWAP_HOOK.uninstall("first")
        assert refit.swap_model_weights is not released  # still wrapped for "second"
        with pytest.raises(TypeError):
            refit.swap_model_weights(None, None, refit_method=object())
        assert seen == ["first", "second", "second"]
    finally:
        SWAP_HOOK.uninstall("first")
        SWAP_HOOK.uninstall("second")
    assert refit.swap_model_weights is released and not SWAP_HOOK.active
