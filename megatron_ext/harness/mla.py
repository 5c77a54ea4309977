"""Multi-latent attention (MLA) GPT models: megatron-core's ``MLATransformerConfig`` and
``MLASelfAttention`` with the local layer spec, and what the harness runs them with.

megatron-core's dynamic engine runs MLA only with ``cache_mla_latents=True`` (``MLASelfAttention
.forward`` asserts it): the KV cache holds one latent vector per token and layer,
``[layers, blocks, block_size, kv_lora_rank + qk_pos_emb_head_dim]``, appended by
``DynamicInferenceContext.append_key_value_cache``'s latent branch (the Triton append is skipped
for MLA), and the context asserts ``block_size_tokens == 64`` (FlashMLA's page size). So every
MLA case caches latents; there is no non-latent MLA path to run.

Two things in megatron-core itself keep the local spec from running, in every release 0.17-0.19:

* the local spec's ``DotProductAttention`` takes no ``k_channels`` / ``v_channels``, which
  ``MultiLatentAttention.__init__`` passes: the harness gives the spec
  :class:`~megatron_ext.cpu_backend.mla.ReferenceMLACoreAttention` (used by a forward without an
  inference context only; the engine's steps go through ``flash_decode_and_prefill``);
* ``MultiLatentAttention.forward`` calls ``flash_decode_and_prefill`` without its required
  ``is_decode_only`` argument (``TypeError`` at the first engine step, on a GPU too; Megatron-LM
  issue #4901, PR #4902 merged upstream, not in 0.17.1, 0.18.2 or 0.19.2): fault M2, fixed by the
  runtime patch ``mla-decode-flag`` (an MLA run without it fails at its first step).

An MTP block over MLA layers (speculative decoding) needs one more: megatron-core runs the MTP
layer's draft forward (``compute_mtp_single_step`` -> ``forward_single_position``) with no
inference context, but a layer built with ``cache_mla_latents`` asserts one (``get_query_key_value_tensors``)
after ``prepare_for_absorption`` deleted its ``linear_kv_up_proj``; 0.19.2 fails at the first draft,
on a GPU too (upstream main later refuses MLA with MTP inference, Megatron-LM PR #7033). The MTP
block gets :func:`mla_draft_attention_class` (:func:`mla_mtp_layer_spec`): its attention keeps no
latents, so the draft forward takes MLA's plain path.

RoPE: ``rope_type`` ``yarn`` (megatron-core's and Megatron-LM's MLA default) builds megatron-core's
``YarnRotaryEmbedding``, which puts its frequencies on ``torch.cuda.current_device()`` at build and
moves them there again at its first forward; on the CPU the CPU backend's ``current_device`` stand-in
and its CUDA-to-CPU device mode keep them CPU tensors (nothing YaRN-specific is patched).

0.17 cannot run MLA with prefix caching: its ``flash_decode_and_prefill`` picks the decode kernel
when every query of a step has one token (``max_seqlen_q == 1``), not when the step is decode-only,
so a mixed step (a prefix-cached prompt recomputing one token beside decoding requests) sends
MLA's unabsorbed queries to FlashMLA. :func:`check_mla_run` refuses it by name.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Optional

from .. import mcore
from ..errors import MegatronExtError

#: Release series whose dynamic engine runs MLA with prefix caching (see the module docstring).
MLA_SERIES = ("0.18", "0.19")

#: The block size megatron-core's latent KV cache asserts (dynamic_context.py, every release).
MLA_BLOCK_SIZE_TOKENS = 64


class MLAUnsupportedError(MegatronExtError, ValueError):
    """An MLA case asked for something megatron-ext cannot run with MLA (the message names it)."""


def check_mla_run(case: Any, version: str, tensor_model_parallel_size: int = 1,
                  pipeline_model_parallel_size: int = 1, trainer_logprobs: Any = None) -> None:
    """Refuse, before anything is built, an MLA case this release or command cannot run.

    A checkpoint (``ab --load``) is fine: it is loaded before the engine's first forward, while the
    model still has megatron-core's own parameter names (``prepare_for_absorption`` renames and
    splits ``linear_kv_up_proj`` at that forward).

    Args:
        case: the :class:`~megatron_ext.harness.cases.Case`; nothing is checked unless
            ``case.model.multi_latent_attention``.
        version: the installed megatron-core release.
        tensor_model_parallel_size, pipeline_model_parallel_size, trainer_logprobs: what ``ab``
            was asked for.

    Raises:
        MLAUnsupportedError: a release outside :data:`MLA_SERIES`, several ranks,
            ``--trainer-logprobs``, or ``weight_updates`` of kind ``train_step`` or ``checkpoint``:
            after the first inference forward megatron-core's ``prepare_for_absorption`` has deleted
            ``linear_kv_up_proj``, so a training forward (``cache_mla_latents conflicts with
            training``) or one without an inference context asserts, and its state dict has other
            names. ``perturb`` updates run: whether they reach every copy of the KV up-projection
            (fault M1) is checked after each (:func:`stale_absorbed_layers`).
    """
    if not getattr(case.model, "multi_latent_attention", False):
        return
    series = mcore.release_series(version)
    if series not in MLA_SERIES:
        raise MLAUnsupportedError(
            f"case '{case.name}': multi-latent attention with prefix caching does not run on megatron-core "
            f"{version}: its flash_decode_and_prefill sends a mixed step whose queries all have one token to "
            f"the FlashMLA decode kernel with unabsorbed queries; use megatron-core 0.18 or 0.19")
    kind = case.weight_updates.kind if case.weight_updates is not None else None
    unsupported = [what for what, asked in (
        (f"tensor/pipeline parallelism (TP={tensor_model_parallel_size} PP={pipeline_model_parallel_size})",
         tensor_model_parallel_size > 1 or pipeline_model_parallel_size > 1),
        ("--trainer-logprobs", trainer_logprobs is not None),
        (f"weight_updates kind {kind} (use kind perturb)", kind in ("train_step", "checkpoint"))) if asked]
    if unsupported:
        raise MLAUnsupportedError(f"case '{case.name}': multi-latent attention models run single-rank, and with cached "
                                  "latents megatron-core runs them only under the dynamic engine (a forward without "
                                  "its inference context, training or the trainer's, asserts after the first "
                                  f"inference forward); drop {', '.join(unsupported)}")


def pre_absorption_name(name: str) -> str:
    """A parameter's name from before ``prepare_for_absorption`` renamed ``linear_kv_up_proj`` to
    ``linear_kv_up_proj_linear`` (``kv_layernorm`` keeps its name on the local spec); other names as given."""
    return name.replace(".linear_kv_up_proj_linear.", ".linear_kv_up_proj.")


def stale_absorbed_layers(model: Any) -> list[int]:
    """Decoder layer numbers (1-based) whose MLA decode-only KV up-projection is not the prefill one.

    After ``prepare_for_absorption`` decode-only steps use ``up_k_weight`` / ``up_v_weight``
    (``[heads, qk_head_dim | v_head_dim, kv_lora_rank]``), prefill and mixed steps
    ``linear_kv_up_proj_linear.weight`` (``[heads * (qk_head_dim + v_head_dim), kv_lora_rank]``);
    they must be equal bit for bit. Unequal after a weight update is fault M1 (patch
    ``mla-absorbed-weights``). Layers not absorbed yet, and models without MLA, give nothing."""
    import torch  # here: the refusals above run before torch is imported

    stale = []
    for layer in getattr(getattr(model, "decoder", None), "layers", ()):
        attention = getattr(layer, "self_attention", None)
        if not hasattr(attention, "up_k_weight") or not hasattr(attention, "linear_kv_up_proj_linear"):
            continue
        up_k, up_v = attention.up_k_weight, attention.up_v_weight
        heads = attention.linear_kv_up_proj_linear.weight.view(up_k.shape[0], up_k.shape[1] + up_v.shape[1], -1)
        if not (torch.equal(heads[:, :up_k.shape[1]], up_k) and torch.equal(heads[:, up_k.shape[1]:], up_v)):
            stale.append(layer.layer_number)
    return stale


#: Why an MLA case's outputs can differ with caching on vs off without any KV-cache fault.
STEP_KIND_NOTE = (
    "multi-latent attention: megatron-core computes a decoding token's attention over the latent cache "
    "(absorbed queries, FlashMLA) in decode-only steps but over keys and values uncompressed from it in "
    "steps that also prefill; prefix caching changes which steps prefill, so such tokens can differ in "
    "their low bits with caching on vs off (docs/ab.md, multi-latent attention)")


def step_kind_warning(case: Any, bit_identical: bool) -> Optional[str]:
    """:data:`STEP_KIND_NOTE` for an MLA case whose runs were not bit-identical, else None."""
    if getattr(case.model, "multi_latent_attention", False) and not bit_identical:
        return STEP_KIND_NOTE
    return None


def mla_config_fields(spec: Any) -> dict[str, Any]:
    """``MLATransformerConfig`` fields of an MLA :class:`~megatron_ext.harness.cases.ModelSpec`.

    The case's ``rope_type`` (``yarn``: megatron-core's ``YarnRotaryEmbedding``; ``rope``:
    ``rotary_base``, ``rotary_percent`` of the ``qk_pos_emb_head_dim`` channels), its YaRN parameters
    (``rotary_scaling_factor`` and ``mscale_all_dim`` also set megatron-core's softmax scale with
    either type) and ``cache_mla_latents``
    True, the only way megatron-core's dynamic engine runs MLA."""
    from .cases.schema import MLA_ROPE_FIELDS

    return dict(q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_head_dim,
                qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim, v_head_dim=spec.v_head_dim,
                rotary_base=spec.rotary_base, rotary_percent=spec.rotary_percent,
                **{name: getattr(spec, name) for name in MLA_ROPE_FIELDS}, cache_mla_latents=True)


@functools.cache
def mla_self_attention_class() -> type:
    """megatron-core's ``MLASelfAttention`` whose KV norm is registered for the CPU backend's
    stand-in of TE's norm / linear split (:func:`~megatron_ext.cpu_backend.mla.register_kv_norm`);
    everything else is megatron-core's class."""
    from ..cpu_backend.mla import register_kv_norm

    base = mcore.import_module(mcore.MLA_MODULE).MLASelfAttention

    class HarnessMLASelfAttention(base):
        """``MLASelfAttention`` with its KV norm registered for the CPU split."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # the local spec's KV norm is kv_layernorm itself: what the latent path's split must keep
            register_kv_norm(self.linear_kv_up_proj, self.kv_layernorm)

    return HarnessMLASelfAttention


def mla_layer_spec(spec: Any) -> Any:
    """The local layer spec of an MLA GPT model (``get_gpt_layer_local_spec(multi_latent_attention=
    True)``, MoE MLPs for a model with ``num_experts``), with :func:`mla_self_attention_class` as its attention module and the CPU backend's
    :class:`~megatron_ext.cpu_backend.mla.ReferenceMLACoreAttention` as its core attention."""
    from ..cpu_backend.mla import ReferenceMLACoreAttention

    layer_specs = mcore.import_module("megatron.core.models.gpt.gpt_layer_specs")
    options: dict[str, Any] = {} if spec.normalization == "LayerNorm" else {"normalization": spec.normalization}
    if spec.is_moe:  # MoE MLPs under MLA (DeepSeek-style)
        options["num_experts"] = spec.num_experts
    layer = layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=spec.qk_layernorm, **options)
    attention = layer.submodules.self_attention
    attention.module = mla_self_attention_class()
    attention.submodules.core_attention = ReferenceMLACoreAttention
    return layer


@functools.cache
def mla_draft_attention_class() -> type:
    """:func:`mla_self_attention_class` built over a copy of its config with ``cache_mla_latents``
    False: the attention of an MTP layer over MLA.

    megatron-core's draft forward (``MultiTokenPredictionLayer.forward_single_position``) calls the
    MTP layer without an inference context: the requests' last accepted positions are one sequence
    with no KV cache. A latent-caching MLA module cannot run that (it drops ``linear_kv_up_proj`` at
    its first forward and asserts a dynamic context), a non-caching one computes keys and values from
    the step's own tokens and runs its core attention
    (:class:`~megatron_ext.cpu_backend.mla.ReferenceMLACoreAttention` on the CPU). The config copy is
    shallow and this module's alone; the decoder's layers keep ``cache_mla_latents``."""
    base = mla_self_attention_class()

    class MLADraftAttention(base):
        """MLA attention of an MTP layer: no latent cache (see :func:`mla_draft_attention_class`)."""

        def __init__(self, config, *args, **kwargs):
            own = copy.copy(config)
            own.cache_mla_latents = False
            super().__init__(own, *args, **kwargs)

    return MLADraftAttention


def mla_mtp_layer_spec(spec: Any) -> Any:
    """The layer spec of an MLA model's MTP block: :func:`mla_layer_spec` with
    :func:`mla_draft_attention_class` as its attention module."""
    layer = mla_layer_spec(spec)
    layer.submodules.self_attention.module = mla_draft_attention_class()
    return layer
