"""The torch dtypes of a case's dtype names (``fp32``, ``bf16``: ``ModelSpec.params_dtype`` and the
Mamba state dtypes), for :mod:`~megatron_ext.harness.engine` and :mod:`~megatron_ext.harness.hybrid`."""

from __future__ import annotations

import torch

#: dtype name in a case -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
