"""Megatron-LM main's inference-layer check without Transformer Engine.

Megatron-LM main (2a75ac12c5) builds an MTP layer by asking
``is_inference_column_parallel_linear(eh_proj)``, an ``isinstance`` over
``InferenceColumnParallelLinear`` and ``InferenceLayerNormColumnParallelLinear``. Those subclass
Transformer Engine's linears; without Transformer Engine megatron-core binds the TE names to
placeholders that are not classes, so the ``isinstance`` raises ``TypeError`` and no MTP model can
be built. No layer can be an instance of a class that does not exist: :func:`local_inference_layers`
puts a check that answers ``False`` for placeholders in the name ``multi_token_prediction`` calls.
Releases 0.17-0.19 have no such check: nothing is replaced there.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ._swap import AttributeSwap

INFERENCE_LAYERS_MODULE = "megatron.core.tensor_parallel.inference_layers"
MTP_MODULE = "megatron.core.transformer.multi_token_prediction"
CHECK = "is_inference_column_parallel_linear"
CLASSES = ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear")


def _inference_column_classes() -> tuple[type, ...]:
    from .. import mcore

    layers = mcore.import_module(INFERENCE_LAYERS_MODULE)
    return tuple(kind for name in CLASSES if isinstance(kind := getattr(layers, name, None), type))


def is_inference_column_parallel_linear(module: Any) -> bool:
    """Whether ``module`` is one of the inference column-parallel linears that exist here."""
    classes = _inference_column_classes()
    return bool(classes) and isinstance(module, classes)


@contextlib.contextmanager
def local_inference_layers() -> Iterator[None]:
    """Within the block the MTP layer's inference-layer check works without Transformer Engine.

    Replaces ``is_inference_column_parallel_linear`` in ``megatron.core.transformer.multi_token_prediction``
    where that module calls it and the inference linears are placeholders (no Transformer Engine);
    puts the original back on exit. Elsewhere (0.17-0.19, or Transformer Engine installed) it changes
    nothing.
    """
    from .. import mcore

    swap = AttributeSwap()
    try:
        mtp = mcore.import_module(MTP_MODULE)
        if hasattr(mtp, CHECK) and len(_inference_column_classes()) < len(CLASSES):
            swap.set(mtp, CHECK, is_inference_column_parallel_linear)
        yield
    finally:
        swap.restore()
