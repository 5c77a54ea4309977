"""Let the dynamic engine's pipeline-parallel communication run on CPU tensors.

``megatron.core.inference.communication_utils`` checks every tensor it sends between pipeline
stages with ``_is_cuda`` (``assert tensor.is_cuda``), looked up as a module global by
``_is_cuda_contiguous``. The gloo backend sends CPU tensors fine; while enabled, the check only
requires a tensor (not None), so PP=2 runs on CPU ranks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ._swap import AttributeSwap

COMMUNICATION_MODULE = "megatron.core.inference.communication_utils"


def _is_tensor(tensor) -> None:
    """Stand-in for ``_is_cuda``: the tensor must exist; any device (CPU under gloo) is accepted.

    Raises:
        AssertionError: ``tensor`` is None (as the original does).
    """
    assert tensor is not None


@contextlib.contextmanager
def cpu_pipeline_comms() -> Iterator[None]:
    """Within the block pipeline-stage sends/broadcasts accept CPU tensors; restored on exit.

    Raises:
        megatron_ext.errors.MegatronCoreNotFoundError: megatron-core is not importable.
    """
    from .. import mcore

    module = mcore.import_module(COMMUNICATION_MODULE)
    swap = AttributeSwap()
    try:
        swap.set(module, "_is_cuda", _is_tensor)
        yield
    finally:
        swap.restore()
