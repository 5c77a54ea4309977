"""Fault H7 (issue 22): a Mamba prefill slice shorter than the conv window loses its conv history.

``MambaMixer._ssm_prefill`` (dynamic batching, 0.17.0 to 0.19.2) writes each prefill request's
new conv state with ``causal_conv1d_varlen_states(xBC, cu_seqlens, state_len=d_conv)``, which
reads only the tokens of this step's slice: for a slice of ``L < d_conv`` tokens the first
``d_conv - L`` columns are zeros instead of the last tokens the request had seen before the slice
(the conv output of the slice itself is right: it reads those from the incoming state). The next
step (decode, or the next prefill chunk) convolves against zeros. A slice that short is what a
prefix-cache restore leaves when a prompt ends 1-2 tokens after a restored Mamba snapshot (a
34-token prompt restoring the snapshot at token 32: the conv state after the 2 computed tokens is
``[0, 0, x33, x34]`` instead of ``[x31, x32, x33, x34]``; with ``d_conv = 4`` the next token reads
``x32`` as 0), and what chunked prefill leaves when a prompt's last chunk is that short. The SSM
state is unaffected. Caching on then differs from caching off by far more than rounding.

Megatron-LM main renamed the method ``ssm_prefill`` (its varlen metadata read from the context;
the fault is still there at 2a75ac12c5, whose ``ssm_prefill`` this patch wraps the same way) and
fixed it in #6711 (2026-08-22, at d98e8a64, in no release yet): the new state is built by
``causal_conv1d_varlen_carry_states(xBC, cu_seqlens, previous_conv_states)``, whose columns come
from the slice where the slice reaches back that far and otherwise from the incoming state. This
patch mirrors that rule: it reads the prefill requests' incoming conv states before the released
``_ssm_prefill`` runs, and afterwards writes back, for every real request, the columns its slice
does not cover (:func:`carry_conv_states`; plain tensor ops, no host synchronisation; the write
goes through the mixer module's own ``tensor_masked_update``, which skips padding rows).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from .. import mcore
from ..fingerprints import TreeMatch
from ..patching import Patch, Target

MAMBA_MIXER_MODULE = "megatron.core.ssm.mamba_mixer"
SSM_PREFILL = Target(MAMBA_MIXER_MODULE, "MambaMixer._ssm_prefill")
#: Megatron-LM main's name for it (after 0.19: ``ssm_prefill(zxBCdt, conv_state, ssm_state, context)``,
#: dynamic batching only, the varlen metadata read from ``context.mamba_metadata``); the fault is
#: there at 2a75ac12c5 and gone at d98e8a64 (#6711).
SSM_PREFILL_CONTEXT = Target(MAMBA_MIXER_MODULE, "MambaMixer.ssm_prefill")


#: ``_ssm_prefill``'s leading parameters after ``self`` (the same in 0.17.0 to 0.19.2).
_PARAMETERS = ("zxBCdt", "conv_state", "ssm_state", "seq_idx", "cu_seqlens", "batch_indices")


def carry_conv_states(previous: torch.Tensor, written: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The conv states after each request's slice, with the history a short slice does not cover.

    A request's conv state holds the last ``d_conv`` inputs it has seen. After a slice of ``L``
    tokens, column ``j`` is slice token ``L - d_conv + j`` when that is ``>= 0`` (what the released
    ``causal_conv1d_varlen_states`` wrote) and otherwise column ``L + j`` of the incoming state (the
    rule of Megatron-LM #6711's ``causal_conv1d_varlen_carry_states``). Values are copied, never
    computed: same bits as the inputs.

    Args:
        previous: ``(R, conv_dim, d_conv)`` incoming conv states of the step's prefill requests
            (``R`` the padded prefill count), any dtype.
        written: ``(R, conv_dim, d_conv)`` states computed from the slices alone.
        cu_seqlens: ``(R + 1,)`` integer slice boundaries of those requests (tokens, from 0).

    Returns:
        ``(R, conv_dim, d_conv)`` new tensor, dtype of ``previous`` (the conv-state dtype, which the
        released write casts to as well).
    """
    d_conv = previous.shape[-1]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    source = lengths[:, None] + torch.arange(d_conv, device=previous.device, dtype=torch.int64)
    from_previous = (source < d_conv)[:, None, :]
    gathered = previous.gather(-1, source.clamp(max=d_conv - 1)[:, None, :].expand_as(previous))
    return torch.where(from_previous, gathered, written.to(previous.dtype))


def _argument(args: tuple, kwargs: dict, name: str) -> Any:
    """``_ssm_prefill``'s argument ``name`` (one of :data:`_PARAMETERS`), passed either way."""
    if name in kwargs:
        return kwargs[name]
    position = _PARAMETERS.index(name)
    return args[position] if position < len(args) else None


def _ssm_prefill_wrapper(wrapped: Callable, mixer: Any, args: tuple, kwargs: dict) -> Any:
    """Run the released prefill; then give each dynamic-batching prefill request the conv-state
    columns its slice does not cover. Other calls (static batching, training) pass through."""
    conv_state = _argument(args, kwargs, "conv_state")
    batch_indices = _argument(args, kwargs, "batch_indices")
    cu_seqlens = _argument(args, kwargs, "cu_seqlens")
    # the released conv-state write happens exactly under these conditions (seq_idx marks dynamic batching)
    if conv_state is None or _argument(args, kwargs, "seq_idx") is None or batch_indices is None:
        return wrapped(*args, **kwargs)
    previous = conv_state[batch_indices]  # a copy, taken before the released write
    result = wrapped(*args, **kwargs)
    carried = carry_conv_states(previous, conv_state[batch_indices], cu_seqlens)
    # the name the mixer looked up: rows of -1 (padding) are skipped
    sys.modules[MAMBA_MIXER_MODULE].tensor_masked_update(conv_state, batch_indices, carried)
    return result


def _ssm_prefill_context_wrapper(wrapped: Callable, mixer: Any, args: tuple, kwargs: dict) -> Any:
    """The same as :func:`_ssm_prefill_wrapper` for main's ``ssm_prefill(zxBCdt, conv_state,
    ssm_state, context)``, which always writes the prefill requests' conv states: the slices and
    the rows come from ``context.mamba_metadata`` (``cu_seqlens``, ``batch_indices_prefill``)."""
    conv_state = kwargs["conv_state"] if "conv_state" in kwargs else args[1]
    context = kwargs["context"] if "context" in kwargs else args[3]
    metadata = context.mamba_metadata
    batch_indices, cu_seqlens = metadata.batch_indices_prefill, metadata.cu_seqlens
    previous = conv_state[batch_indices]  # a copy, taken before the released write
    result = wrapped(*args, **kwargs)
    carried = carry_conv_states(previous, conv_state[batch_indices], cu_seqlens)
    sys.modules[MAMBA_MIXER_MODULE].tensor_masked_update(conv_state, batch_indices, carried)
    return result


def prefill_target() -> Target:
    """The prefill method the installed mixer has: ``_ssm_prefill`` (0.17 to 0.19) or main's
    ``ssm_prefill``. Imports nothing: before the mixer module is loaded (the start-up hook runs
    inside megatron-core's own, circular, imports) its file says which."""
    module = sys.modules.get(MAMBA_MIXER_MODULE)
    if module is not None and hasattr(module, "MambaMixer"):
        return SSM_PREFILL if SSM_PREFILL.attribute in vars(module.MambaMixer) else SSM_PREFILL_CONTEXT
    core = sys.modules.get("megatron.core") or mcore.import_module("megatron.core")
    try:
        source = (Path(core.__file__).parent / "ssm" / "mamba_mixer.py").read_text(encoding="utf-8")
    except OSError:  # no such file: the patch has nothing to wrap either way
        return SSM_PREFILL
    return SSM_PREFILL if f"def {SSM_PREFILL.attribute}(" in source else SSM_PREFILL_CONTEXT


def writes_slice_only_conv_state(ssm_prefill: Callable) -> tuple[bool, str]:
    """Whether ``_ssm_prefill`` builds the new conv state from the slice alone. Reads its source.
    Returns ``(has_fault, evidence)``."""
    source = inspect.getsource(ssm_prefill)
    if "causal_conv1d_varlen_carry_states" in source:
        return False, "_ssm_prefill carries the incoming conv state (causal_conv1d_varlen_carry_states, #6711)"
    if "_carry_conv_states(" in source:
        return False, "_ssm_prefill carries the incoming conv state (_carry_conv_states of patches/)"
    if "causal_conv1d_varlen_states(" not in source:
        return False, "_ssm_prefill does not compute conv states with causal_conv1d_varlen_states"
    return True, ("_ssm_prefill writes causal_conv1d_varlen_states(xBC, cu_seqlens, d_conv): a slice "
                  "shorter than d_conv leaves zeros where the request's earlier inputs belong")


class MambaConvCarryPatch(Patch):
    """Keeps a short prefill slice's conv history in the Mamba conv state (see module docstring)."""

    name = "mamba-conv-carry"
    fault = "H7"
    source_patched_targets = (SSM_PREFILL,)
    waits_for_import = (SSM_PREFILL,)

    def wrappers(self) -> dict[Target, Callable]:
        if prefill_target() is SSM_PREFILL_CONTEXT:
            return {SSM_PREFILL_CONTEXT: _ssm_prefill_context_wrapper}
        return {SSM_PREFILL: _ssm_prefill_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        """Both names: each tree has one of them (the other is recorded absent)."""
        return (SSM_PREFILL, SSM_PREFILL_CONTEXT)

    def match(self) -> TreeMatch:
        """As recorded; for code that is no known tree's (source-patched code, an edited tree) the
        name the installed mixer lacks by design is left out, so that it is not taken for a missing
        target: the probe (:meth:`needed`) then decides on the prefill method the mixer has."""
        match = super().match()
        if match.faulty or match.fixed:
            return match
        other = (SSM_PREFILL if prefill_target() is SSM_PREFILL_CONTEXT else SSM_PREFILL_CONTEXT).qualname
        return dataclasses.replace(match, found={k: v for k, v in match.found.items() if k != other},
                                   differing=tuple(name for name in match.differing if name != other))

    def needed(self) -> tuple[bool, str]:
        """Not needed on source-patched code (fingerprint) nor on code that carries the state
        itself (:func:`writes_slice_only_conv_state`)."""
        target = prefill_target()
        if target is SSM_PREFILL:  # the source patches of patches/ edit _ssm_prefill
            needed, evidence = super().needed()
            if not needed:
                return needed, evidence
        return writes_slice_only_conv_state(target.original())
