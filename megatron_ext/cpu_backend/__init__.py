"""Run megatron-core's unmodified dynamic inference stack on the CPU.

``with cpu_backend():`` lets ``DynamicInferenceContext``, ``DynamicInferenceEngine``,
``TextGenerationController`` and ``GPTModel`` (local layer spec, no Transformer Engine) of
megatron-core 0.17.1, 0.18.2, 0.19.2 and Megatron-LM main (2a75ac12c5) run without a GPU, by combining four pieces that are also
usable on their own:

* :func:`cuda_on_cpu` (``device``): CUDA devices, pinned memory, ``torch.cuda`` events, streams
  and RNG state served on the CPU;
* :func:`reference_attention` (``attention``): plain-torch paged attention in place of the
  flash-attention kernels, computed per query token so results do not depend on the batch;
* :func:`torch_kv_append` (``kv_append``): the Triton KV-append kernel off;
* :func:`cpu_pipeline_comms` (``pipeline``): pipeline-stage communication accepts CPU tensors;
* :func:`batch_invariant_mode` (``batch_invariant``): row-wise CPU matrix products, so a row's
  bits do not depend on the batch; :func:`self_check` proves it on the running machine;
* :func:`mla_on_cpu` (``mla``): plain-torch FlashMLA decode and the Transformer Engine split
  that multi-latent attention's latent KV cache (``cache_mla_latents``) calls;
* :func:`local_inference_layers` (``inference_layers``): Megatron-LM main's MTP inference-layer
  check answered without Transformer Engine (its classes are placeholders there);
* :func:`mamba_on_cpu` (``mamba``, hybrid models only): megatron's Mamba Triton kernels under
  Triton's interpreter, stand-ins for the compiled Mamba extensions and plain-torch copies in
  place of the CUDA-asserting state-copy helpers.

Building a model, context and engine from a case is :mod:`megatron_ext.harness.engine`'s job (the same
constructors in all three releases); stepping it is :func:`megatron_ext.harness.step_loop.drive`.
Everything is restored exactly when the ``with`` block exits.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .attention import (full_sequence_attention, kvcache_attention, matched_training_attention,
                        reference_attention, varlen_attention)
from .batch_invariant import batch_invariant_mode, self_check
from .device import cuda_on_cpu
from .inference_layers import local_inference_layers
from .kv_append import torch_kv_append
from .mamba import mamba_on_cpu
from .mla import mla_on_cpu
from .pipeline import cpu_pipeline_comms

__all__ = [
    "cpu_backend",
    "cuda_on_cpu",
    "reference_attention",
    "varlen_attention",
    "kvcache_attention",
    "full_sequence_attention",
    "matched_training_attention",
    "torch_kv_append",
    "cpu_pipeline_comms",
    "batch_invariant_mode",
    "self_check",
    "mamba_on_cpu",
    "mla_on_cpu",
    "local_inference_layers",
]


@contextlib.contextmanager
def cpu_backend(batch_invariant: bool = True, seed: Optional[int] = None, mamba: bool = False) -> Iterator[None]:
    """Within the block megatron-core's dynamic inference runs on the CPU.

    Enters, in order: :func:`torch_kv_append`, :func:`reference_attention`, :func:`mla_on_cpu`
    (they import the megatron-core modules they patch, so those imports happen before any CUDA
    stand-in exists),
    (with ``mamba``) :func:`mamba_on_cpu`, :func:`local_inference_layers`, :func:`cuda_on_cpu` and (unless ``batch_invariant`` is
    False) :func:`batch_invariant_mode`;
    exits in reverse order, restoring every replaced attribute and the previous
    batch-invariant state, also when the block raises.

    Args:
        batch_invariant: also turn on the batch-invariant CPU matrix products.
        seed: initial seed of the stand-in CUDA RNG state (see :func:`cuda_on_cpu`).
        mamba: also run megatron-core's Mamba layers (hybrid models); needs ``TRITON_INTERPRET=1``
            and ``MAMBA_DETERMINISTIC=1`` in the environment from process start.

    Raises:
        megatron_ext.errors.MegatronCoreNotFoundError: megatron-core is not importable.
        RuntimeError: CUDA is already initialized in this process; with ``mamba``: Triton's
            interpreter is off, or megatron-core's Mamba mixer was imported before.
        ImportError: with ``mamba``: mamba-ssm / causal-conv1d are not installed.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch_kv_append())
        stack.enter_context(cpu_pipeline_comms())
        stack.enter_context(reference_attention())
        stack.enter_context(mla_on_cpu())
        if mamba:
            stack.enter_context(mamba_on_cpu())
        stack.enter_context(local_inference_layers())  # after the Mamba mixer's first import
        stack.enter_context(cuda_on_cpu(seed=seed))
        if batch_invariant:
            stack.enter_context(batch_invariant_mode(True))
        yield
