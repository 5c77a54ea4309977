"""Fault M1: after MLA's absorption a weight update reaches one of two copies of the KV up-projection.

With ``cache_mla_latents`` (the only way megatron-core's dynamic engine runs multi-latent
attention) the first forward of an ``MLASelfAttention`` module calls
``prepare_for_absorption`` once: it splits the fused ``linear_kv_up_proj`` (norm + linear) with
Transformer Engine's ``split_te_layernorm_column_parallel_linear``, which builds a new norm and a
new linear and *copies* the weights into them (``kv_layernorm`` and ``linear_kv_up_proj_linear``:
prefill and mixed steps uncompress the latent cache with them), keeps ``up_k_weight`` /
``up_v_weight`` as views of the fused layer's weight (decode-only steps absorb them into queries
and outputs) and deletes ``linear_kv_up_proj``. The KV up-projection then lives in two unlinked
tensors. A refit or optimizer holding the parameters from before the first forward updates the
views' storage only (prefill steps keep the old weights); ``named_parameters()`` after it lists
the copy only (decode-only steps keep the old weights); ``load_state_dict`` of a state dict under
megatron-core's own names misses the up-projection (strict: an error; non-strict: the old
weights, silently). Same code in 0.17.1, 0.18.2 and 0.19.2; no upstream report or fix is known.

The fix wraps ``prepare_for_absorption``: after the released split, each parameter of the split
norm and linear that is an exact copy of the fused layer's (same shape, dtype and values) is
replaced by that very parameter, so the views, the split modules and every handle taken before
the first forward share one storage and any in-place update (``param.data.copy_``, an optimizer
step, ``load_state_dict``) reaches every path. A state-dict pre-hook on the module maps
megatron-core's pre-absorption keys (``linear_kv_up_proj.*``) to the split modules' names. A
module absorbed before :func:`megatron_ext.apply` keeps two copies (the automatic entry points
apply before any model runs); one absorbed while the patch was applied keeps one storage after a
revert.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..mcore import MLA_MODULE
from ..patching import Patch, Target

PREPARE = Target(MLA_MODULE, "MLASelfAttention.prepare_for_absorption")

#: fused-layer parameter -> (split module attribute, parameter name): TE's fused norm + linear
#: (``layer_norm_*``) and the linear's own parameters.
FUSED_TO_SPLIT = {"layer_norm_weight": ("kv_layernorm", "weight"), "layer_norm_bias": ("kv_layernorm", "bias"),
                  "weight": ("linear_kv_up_proj_linear", "weight"), "bias": ("linear_kv_up_proj_linear", "bias")}


def _source_parameters(fused: torch.nn.Module, norm_before: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """(split module attribute, parameter name) -> the pre-absorption parameter it copies.

    ``norm_before`` is the module's ``kv_layernorm`` before the split: with TE an identity (the
    norm is fused into ``linear_kv_up_proj``), with the local spec the norm itself."""
    sources = {FUSED_TO_SPLIT[name]: p for name, p in fused.named_parameters(recurse=False) if name in FUSED_TO_SPLIT}
    for name, p in norm_before.named_parameters(recurse=False):
        sources.setdefault(("kv_layernorm", name), p)
    return sources


def share_split_weights(attention: Any, fused: torch.nn.Module, norm_before: torch.nn.Module) -> int:
    """Make the split norm and linear hold the pre-absorption parameters they copy.

    Args:
        attention: an absorbed ``MultiLatentAttention`` (``kv_layernorm``, ``linear_kv_up_proj_linear``).
        fused: its ``linear_kv_up_proj`` from before the split.
        norm_before: its ``kv_layernorm`` from before the split.

    Returns the number of parameters replaced (a parameter that is not an exact copy is left alone).
    """
    shared = 0
    for (attribute, name), source in _source_parameters(fused, norm_before).items():
        module = getattr(attention, attribute)
        copy = module._parameters.get(name)
        if copy is None or copy is source:
            continue
        if copy.shape == source.shape and copy.dtype == source.dtype and torch.equal(copy, source):
            setattr(module, name, source)
            shared += 1
    return shared


def _fused_names_hook(state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: keys under megatron-core's pre-absorption names
    (``<prefix>linear_kv_up_proj.<name>``) are moved to the split modules' (``kv_layernorm.*``,
    ``linear_kv_up_proj_linear.*``); a key the state dict holds under both names keeps the split one."""
    fused_prefix = prefix + "linear_kv_up_proj."
    for key in [k for k in state_dict if k.startswith(fused_prefix)]:
        name = key[len(fused_prefix):]
        attribute, split_name = FUSED_TO_SPLIT.get(name, ("linear_kv_up_proj_linear", name))
        value = state_dict.pop(key)
        state_dict.setdefault(f"{prefix}{attribute}.{split_name}", value)


def _prepare_wrapper(wrapped: Callable, attention: Any, args: tuple, kwargs: dict) -> Any:
    """``prepare_for_absorption``; on the call that absorbs, the split shares the fused weights."""
    if hasattr(attention, "up_k_weight") or not hasattr(attention, "linear_kv_up_proj"):
        return wrapped(*args, **kwargs)  # absorbed already: the released call does nothing
    fused, norm_before = attention.linear_kv_up_proj, attention.kv_layernorm
    result = wrapped(*args, **kwargs)
    share_split_weights(attention, fused, norm_before)
    attention._register_load_state_dict_pre_hook(_fused_names_hook)
    return result


class MlaAbsorbedWeightsPatch(Patch):
    """One storage for MLA's absorbed and split KV up-projection (see module docstring)."""

    name = "mla-absorbed-weights"
    fault = "M1"
    source_patched_targets = (PREPARE,)
    waits_for_import = (PREPARE,)  # imported with the model's layer specs, maybe mid-import
    fault_evidence = ("prepare_for_absorption copies the KV up-projection into split modules and keeps views of "
                      "the fused weight (no megatron-core release up to 0.19.2 links them)")

    def wrappers(self) -> dict[Target, Callable]:
        return {PREPARE: _prepare_wrapper}
