"""Turn off the Triton KV-append kernel so the dynamic context's plain torch append runs.

``DynamicInferenceContext.append_key_value_cache`` calls the module attribute
``triton_append_key_value_cache`` when it is not None (it is None when Triton failed to import).
Triton kernels need a GPU; with the attribute set to None the context writes the KV cache with
ordinary tensor indexing, which runs anywhere.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ._swap import AttributeSwap

#: Module holding the attribute, and the attribute's name.
DYNAMIC_CONTEXT_MODULE = "megatron.core.inference.contexts.dynamic_context"
TRITON_APPEND_ATTRIBUTE = "triton_append_key_value_cache"


@contextlib.contextmanager
def torch_kv_append() -> Iterator[None]:
    """Within the block ``dynamic_context.triton_append_key_value_cache`` is None.

    The previous value is put back on exit.

    Raises:
        megatron_ext.errors.MegatronCoreNotFoundError: megatron-core is not importable.
    """
    from .. import mcore

    module = mcore.import_module(DYNAMIC_CONTEXT_MODULE)
    swap = AttributeSwap()
    try:
        swap.set(module, TRITON_APPEND_ATTRIBUTE, None)
        yield
    finally:
        swap.restore()
