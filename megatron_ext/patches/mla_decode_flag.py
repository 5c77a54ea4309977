"""Fault M2: MLA's dynamic-batching forward leaves out ``flash_decode_and_prefill``'s ``is_decode_only``.

``MultiLatentAttention.forward`` with cached latents (the only MLA path of the dynamic engine)
calls ``self.flash_decode_and_prefill(q, k, v, max_seqlen_q, max_seqlen_k, cu_query_lengths,
cu_kv_lengths, kv_lengths, block_table)``, while ``Attention.flash_decode_and_prefill`` requires
``is_decode_only`` as its tenth argument: every dynamic engine step of an MLA model raises
``TypeError`` (0.17.1, 0.18.2, 0.19.2, on a GPU as on the CPU), so no released wheel runs MLA
under the dynamic engine, caching on or off.

Mirrors Megatron-LM PR #4902 (issue #4901; merged upstream, in no release up to 0.19.2), which
passes ``inference_context.is_decode_only()``. The wrapper of ``forward`` shadows the instance's
``flash_decode_and_prefill`` for the call with one that adds the flag where the call leaves it
out; a forward without a dynamic inference context goes to the released code.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ..mcore import ATTENTION_MODULE, MLA_MODULE
from ..patching import Patch, ShadowedMethod, Target

FORWARD = Target(MLA_MODULE, "MultiLatentAttention.forward")
FLASH = Target(ATTENTION_MODULE, "Attention.flash_decode_and_prefill")

#: ``flash_decode_and_prefill``'s positional arguments before ``is_decode_only`` (q to block_table).
ARGUMENTS_BEFORE_FLAG = 9

#: ``forward(hidden_states, attention_mask, key_value_states, inference_context, ...)``
CONTEXT_POSITION = 3


def _forward_wrapper(wrapped: Callable, attention: Any, args: tuple, kwargs: dict) -> Any:
    """``forward`` with ``is_decode_only`` passed to the dynamic-batching attention call."""
    context = args[CONTEXT_POSITION] if len(args) > CONTEXT_POSITION else kwargs.get("inference_context")
    context = context if context is not None else kwargs.get("inference_params")
    if context is None or context.is_static_batching():
        return wrapped(*args, **kwargs)
    flash = attention.flash_decode_and_prefill

    def with_flag(*call_args: Any, **call_kwargs: Any) -> Any:
        if len(call_args) == ARGUMENTS_BEFORE_FLAG and "is_decode_only" not in call_kwargs:
            call_kwargs["is_decode_only"] = context.is_decode_only()
        return flash(*call_args, **call_kwargs)

    with ShadowedMethod(attention, "flash_decode_and_prefill", with_flag):
        return wrapped(*args, **kwargs)


class MlaDecodeFlagPatch(Patch):
    """Passes ``is_decode_only`` from MLA's dynamic-batching forward (see module docstring)."""

    name = "mla-decode-flag"
    fault = "M2"
    source_patched_targets = (FORWARD,)
    waits_for_import = (FORWARD,)  # imported with the model's layer specs, maybe mid-import
    fault_evidence = ("MultiLatentAttention.forward calls flash_decode_and_prefill without is_decode_only, "
                      "which Attention.flash_decode_and_prefill requires (PR #4902 is in no release up to 0.19.2)")

    def wrappers(self) -> dict[Target, Callable]:
        return {FORWARD: _forward_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (FORWARD, FLASH)

    def needed(self) -> tuple[bool, str]:
        if "is_decode_only" not in inspect.signature(FLASH.original()).parameters:
            return False, "Attention.flash_decode_and_prefill takes no is_decode_only"
        return super().needed()
