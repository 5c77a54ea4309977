"""Fault H3 (issue 22): 0.17's hybrid context rebuilds its Mamba metadata with chunk size 128.

``DynamicInferenceContext.__init__`` first builds ``self.mamba_metadata`` with the model's
``mamba_chunk_size``, then calls ``_allocate_mamba_states``, which in 0.17.0 / 0.17.1 builds it
again as ``MambaMetadata(max_requests=..., max_tokens=..., d_conv=...)``: the chunk size falls back
to the class default, 128. The prefill metadata then cuts prompts into 128-token chunks while the
model's Mamba layers scan with their own chunk size, so a model whose ``mamba_chunk_size`` is not
128 gets wrong prefill outputs on every request (and caching on vs off differ, since a restored
request starts its scan elsewhere). 0.18.0 passes the chunk size in ``_allocate_mamba_states``
(Megatron-LM #4306); this patch mirrors that: after the released ``_allocate_mamba_states`` runs,
a hybrid context whose metadata holds another chunk size than the context's gets the metadata
rebuilt with the same arguments plus ``mamba_chunk_size=self.mamba_chunk_size``.

Covers contexts built after :func:`megatron_ext.apply` (the fault happens in ``__init__``);
``import megatron_ext.auto`` / ``MEGATRON_EXT_AUTO=1`` apply before any context exists.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ..mcore import DYNAMIC_CONTEXT_MODULE
from ..patching import Patch, Target

ALLOCATE = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._allocate_mamba_states")


def _allocate_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict) -> Any:
    """Run the released allocation, then give the Mamba metadata the context's chunk size.

    ``context.mamba_metadata`` (a ``MambaMetadata``) is replaced only for a hybrid context whose
    metadata's ``mamba_chunk_size`` (tokens) differs from ``context.mamba_chunk_size``.
    """
    result = wrapped(*args, **kwargs)
    # the released function builds mamba_metadata whenever the model is hybrid
    if context.is_hybrid_model and context.mamba_metadata.mamba_chunk_size != context.mamba_chunk_size:
        context.mamba_metadata = type(context.mamba_metadata)(
            max_requests=context.max_requests,
            max_tokens=context.max_tokens,
            mamba_chunk_size=context.mamba_chunk_size,
            d_conv=context.mamba_conv_states_shape[-1],
        )
    return result


def drops_chunk_size(allocate: Callable) -> tuple[bool, str]:
    """Whether ``_allocate_mamba_states`` builds ``MambaMetadata`` without ``mamba_chunk_size``.

    Reads the function's source (no context is built, so it needs neither a GPU nor a model).
    Returns ``(has_fault, evidence)``.
    """
    source = inspect.getsource(allocate)
    if "MambaMetadata(" not in source:
        return False, "_allocate_mamba_states builds no MambaMetadata: the context's own is kept"
    if "mamba_chunk_size" in source:
        return False, "_allocate_mamba_states passes mamba_chunk_size to MambaMetadata (#4306 present)"
    return True, "_allocate_mamba_states builds MambaMetadata without mamba_chunk_size (default 128)"


class MambaChunkSizePatch(Patch):
    """Keeps the model's Mamba chunk size in 0.17's prefill metadata (see module docstring)."""

    name = "mamba-chunk-size"
    fault = "H3"

    def wrappers(self) -> dict[Target, Callable]:
        return {ALLOCATE: _allocate_wrapper}

    def needed(self) -> tuple[bool, str]:
        return drops_chunk_size(ALLOCATE.original())
