"""NumPy views of megatron-core's CPU bookkeeping tensors, kept per owner.

On the admission path a torch indexing call costs 1 to 4 µs (its dispatch, on a cold cache after
an engine step); the same read or write through a NumPy view of a CPU tensor costs a fraction
of that. 0.18 and 0.19 keep the context's bookkeeping (``token_to_block_idx``, the block tables,
``request_kv_block_counts``) and the allocator's on the CPU; 0.17 keeps it on the GPU, where the
tensor itself is returned and torch's own indexing is used.
"""

from __future__ import annotations

from typing import Any

#: Attribute kept on an owner (a context or an allocator): ``{name: (tensor, view)}``.
VIEWS_ATTR = "_megatron_ext_numpy_views"


def cpu_view(owner: Any, name: str) -> Any:
    """``getattr(owner, name)`` (a tensor) as a NumPy view sharing its memory where it lives on the
    CPU, else the tensor itself. The view is kept on ``owner`` and made again when the attribute
    holds another tensor, so a write never goes to a tensor the owner has replaced.

    Raises:
        AttributeError: ``owner`` has no attribute ``name``.
    """
    tensor = getattr(owner, name)
    if tensor.device.type != "cpu":  # the tensor itself: nothing to keep (a kept reference would
        return tensor  # hold GPU memory a RECOMPUTE suspend deletes the attribute to free)
    views = owner.__dict__.get(VIEWS_ATTR)
    if views is None:
        views = owner.__dict__[VIEWS_ATTR] = {}
    else:
        cached = views.get(name)
        if cached is not None and cached[0] is tensor:
            return cached[1]
    view = tensor.numpy()
    views[name] = (tensor, view)
    return view
