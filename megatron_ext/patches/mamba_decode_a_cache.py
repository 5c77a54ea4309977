"""Fault H11: after a weight update, Mamba decode steps keep using the old ``A = -exp(A_log)``.

megatron-core 0.18.0 to 0.19.2 and Megatron-LM main (2a75ac12c5, d98e8a64) keep
``MambaMixer._A_neg_exp_cache``, a float32 ``(nheads_local,)`` tensor holding
``-exp(A_log.float())``, filled by ``_get_decode_A_neg_exp`` at the first decode step after it is
marked stale. Only ``train(True)`` marks it stale (d98e8a64 also refills it in ``train(False)``
when stale, ``refresh_cache()``, Megatron-LM #6672). The engine runs under
``torch.inference_mode``, so every decode step reads the cache while prefill computes
``-exp(A_log)`` afresh: after a weight update that never switches the model to training
(``param.data.copy_`` / ``add_`` inside ``engine.suspend()`` / ``resume()``,
``load_state_dict``, ``swap_model_weights``, weights restored in place between two engines on one
model) decode runs the old ``A`` and prefill the new one, with no error. 0.17 has no cache.
Reported upstream as Megatron-LM issue #6723 (open); main's #6672 covers the reshard path and
``train(False)`` only.

The fix wraps ``_get_decode_A_neg_exp``: it compares a stamp of ``A_log`` kept on the mixer,
``(data_ptr, _version, generation)``, with the current one and marks the cache stale when they
differ, so the released call refills it on the inference path (an
in-place ``copy_`` or ``load_state_dict`` bumps ``_version``; ``param.data.add_`` does not).
``generation`` is a process-wide count of weight-update signals: ``engine.resume()``
(``reinitialize_inference_state_buffers``), a new context (``initialize_all_tensors``), each
``swap_model_weights`` (:mod:`.swap_hook`) and :func:`refresh_all` (called by
:func:`megatron_ext.invalidate_prefix_cache`). Each signal also refills, at once and into the same
storage, the cache of every mixer that has decoded and is not training: a CUDA graph replays the
cache's address and never runs the Python check. No upstream change to mirror (issue #6723 has
no fix).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

from .. import mcore
from ..patching import Patch, Target
from .swap_hook import SWAP_HOOK

MAMBA_MIXER_MODULE = "megatron.core.ssm.mamba_mixer"
DECODE_A = Target(MAMBA_MIXER_MODULE, "MambaMixer._get_decode_A_neg_exp")
# Relied on: the only other place that marks the cache stale (or, d98e8a64, refills it).
TRAIN = Target(MAMBA_MIXER_MODULE, "MambaMixer.train")
# Signals of a weight update: engine.resume(), and a new context on the model (its __init__).
RESUME = Target(mcore.DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.reinitialize_inference_state_buffers")
NEW_CONTEXT = Target(mcore.DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.initialize_all_tensors")

#: On each mixer that decoded: the stamp of ``A_log`` its cache was filled from.
STAMP_ATTR = "_megatron_ext_decode_a_stamp"

#: Weight-update signals so far (part of every stamp: a signal makes each stamp stale).
_generation = 0
#: The mixers that have decoded (added when first seen), refilled eagerly at each signal.
_MIXERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LOCK = threading.Lock()


def _stamp(a_log: torch.Tensor) -> tuple[int, int, int]:
    return a_log.data_ptr(), a_log._version, _generation


def _decode_a_wrapper(wrapped: Callable, mixer: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``_get_decode_A_neg_exp()``, after marking the cache stale when ``A_log`` changed since its
    stamp. Runs once per Mamba layer and decode step, so it tests nothing else: in training or
    with grad enabled the released code computes A afresh and leaves the stale flag set, so the
    next inference call refills the cache."""
    state = mixer.__dict__
    a_log = state["_parameters"]["A_log"]
    stamp = (a_log.data_ptr(), a_log._version, _generation)
    if state.get(STAMP_ATTR) != stamp:
        if STAMP_ATTR not in state:
            _MIXERS.add(mixer)
        mixer._A_neg_exp_cache_stale = True
        state[STAMP_ATTR] = stamp
    return wrapped(*args, **kwargs)


def refill(mixer: Any) -> bool:
    """Refill ``mixer``'s cache from its ``A_log`` in place (same storage: CUDA graphs replay its
    address) and stamp it; a training mixer is left alone. Whether it was refilled."""
    if mixer.training:
        return False
    a_log = mixer.A_log
    with torch.no_grad():
        mixer._A_neg_exp_cache.copy_(-torch.exp(a_log.float()))
    mixer._A_neg_exp_cache_stale = False
    mixer.__dict__[STAMP_ATTR] = _stamp(a_log)
    return True


def refresh_all() -> int:
    """A weight-update signal: every stamp goes stale and every mixer that has decoded and is not
    training is refilled now. Returns the number refilled."""
    global _generation
    with _LOCK:
        _generation += 1
        return sum(refill(mixer) for mixer in list(_MIXERS))


def _signal_after(wrapped: Callable, _context: Any, args: tuple, kwargs: dict) -> Any:
    """A context method that marks a weight update (``resume()``, a new context): refresh after it,
    whether or not it reallocated anything."""
    try:
        return wrapped(*args, **kwargs)
    finally:
        refresh_all()


class MambaDecodeACachePatch(Patch):
    """Refreshes the Mamba decode cache of ``-exp(A_log)`` after weight updates (see module docstring)."""

    name = "mamba-decode-a-cache"
    fault = "H11"
    source_patched_targets = (DECODE_A,)
    waits_for_import = (DECODE_A,)  # the mixer module is imported with the model's layer specs, maybe mid-import
    fault_evidence = ("MambaMixer._get_decode_A_neg_exp refills its cache of -exp(A_log) only after train(True): "
                      "decode steps keep the old A after a weight update in eval mode (Megatron-LM issue #6723)")

    def wrappers(self) -> dict[Target, Callable]:
        return {DECODE_A: _decode_a_wrapper, RESUME: _signal_after, NEW_CONTEXT: _signal_after}

    def needed(self) -> tuple[bool, str]:
        """Code without the decode cache (0.17) has no fault; otherwise the source-patched check."""
        mixer = mcore.import_module(MAMBA_MIXER_MODULE).MambaMixer
        if not hasattr(mixer, "_get_decode_A_neg_exp"):
            return False, "MambaMixer has no decode cache of -exp(A_log) (_get_decode_A_neg_exp absent, as in 0.17)"
        return super().needed()

    def checked_functions(self) -> tuple[Target, ...]:
        """The decode function and ``train`` (the cache's only other writer). The context methods
        are signals only, whatever their code: a change there is no reason to refuse."""
        return (DECODE_A, TRAIN)

    def install(self) -> None:
        super().install()
        SWAP_HOOK.install(self.name, refresh_all)
        refresh_all()  # applied again after a revert: weights may have changed unseen meanwhile

    def uninstall(self) -> bool:
        SWAP_HOOK.uninstall(self.name)
        return super().uninstall()
