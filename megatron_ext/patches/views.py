"""NumPy views of megatron-core's CPU bookkeeping tensors, kept on the tensors themselves.

On the admission path a torch indexing call costs 1 to 4 µs (its dispatch, on a cold cache after
an engine step); the same read or write through a NumPy view of a CPU tensor costs a fraction
of that. 0.18 and 0.19 keep the context's bookkeeping (``token_to_block_idx``, the block tables,
``request_kv_block_counts``) and the allocator's on the CPU; 0.17 keeps it on the GPU, where the
tensor itself is returned and torch's own indexing is used.
"""

from __future__ import annotations

from typing import Any

#: Attribute kept on a CPU tensor: a NumPy view of its memory. The view refers to an alias of the
#: tensor, not to the tensor object, so the tensor is freed when its owner lets go of it (a
#: RECOMPUTE-mode suspend deletes the context's tensors to free them), view and all; and a view
#: kept on the tensor is always a view of the tensor the owner holds now.
VIEW_ATTR = "_megatron_ext_numpy_view"


def cpu_view(owner: Any, name: str) -> Any:
    """``getattr(owner, name)`` (a tensor) as a NumPy view sharing its memory where it lives on the
    CPU, else the tensor itself.

    Raises:
        AttributeError: ``owner`` has no attribute ``name``.
    """
    tensor = getattr(owner, name)
    view = tensor.__dict__.get(VIEW_ATTR)
    if view is not None:
        return view
    if tensor.device.type != "cpu":
        return tensor
    view = tensor.__dict__[VIEW_ATTR] = tensor.numpy()
    return view
