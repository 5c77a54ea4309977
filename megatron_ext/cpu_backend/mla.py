"""Multi-latent attention (MLA) on the CPU: plain-torch stand-ins for FlashMLA and a TE helper.

megatron-core's dynamic inference runs MLA only with ``cache_mla_latents`` (one latent vector per
token and layer in the KV cache: ``kv_lora_rank`` channels of compressed KV followed by the
``qk_pos_emb_head_dim`` RoPE channels of the key). It then needs, besides the flash-attention
calls :mod:`.attention` already serves (prefill and mixed steps attend over keys and values
uncompressed from the latent cache):

* FlashMLA for decode-only steps: ``flash_mla_with_kvcache`` and ``get_mla_metadata``, names
  ``megatron.core.transformer.attention`` imports (None without the ``flash_mla`` package).
  :func:`flash_mla_attention` is a reference: multi-query attention of the absorbed queries over
  the latent cache (one KV head), whose values are the first ``head_dim_v`` latent channels.
* Transformer Engine's ``split_te_layernorm_column_parallel_linear``, which
  ``MultiLatentAttention.prepare_for_absorption`` calls on ``linear_kv_up_proj`` to take the KV
  norm out of a fused norm + linear (None without TE). :func:`split_norm_linear` serves the local
  layer spec, whose KV norm is a module of its own (``kv_layernorm``) already.

:func:`mla_on_cpu` installs the three while enabled. Numerics follow :mod:`.attention`: every
query token on its own, in float32, so results do not depend on the batch.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Any, Iterator, Optional

import torch

from ._swap import AttributeSwap
from .attention import ATTENTION_MODULE, attend_sequence, gather_paged

#: Module whose ``split_te_layernorm_column_parallel_linear`` is replaced.
MLA_MODULE = "megatron.core.transformer.multi_latent_attention"


def mla_metadata(cache_seqlens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int,
                 *args: Any, **kwargs: Any) -> tuple[None, None]:
    """Stand-in for ``flash_mla.get_mla_metadata``: the reference needs no tile schedule.

    Returns ``(None, None)`` for ``(tile_scheduler_metadata, num_splits)``, which
    :func:`flash_mla_attention` ignores."""
    return None, None


def flash_mla_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: Any = None,
    num_splits: Any = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    **unsupported: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for ``flash_mla.flash_mla_with_kvcache``: decode attention over the latent cache.

    Args:
        q: ``[B, Sq, H, D]`` absorbed queries (``D = kv_lora_rank + qk_pos_emb_head_dim``).
        k_cache: ``[num_blocks, block_size, 1, D]`` latent cache (one KV head).
        block_table: ``[Bc, max_blocks]`` int32 block ids, ``-1`` past each sequence's blocks.
        cache_seqlens: ``[Bc]`` int32 tokens cached per sequence, the new ones included.
        head_dim_v: value channels: the first ``head_dim_v`` channels of each latent vector.
        tile_scheduler_metadata, num_splits: :func:`mla_metadata`'s answer; ignored.
        softmax_scale: multiplier of ``q . k``; defaults to ``D ** -0.5``.
        causal: bottom-right-aligned causal mask (queries are the last ``Sq`` cached tokens).

    Returns:
        ``(out, lse)``: ``out`` ``[B, Sq, H, head_dim_v]`` in ``q.dtype``, ``lse`` ``[B, H, Sq]``
        float32. Rows past ``Bc`` (padding) are zero, ``lse`` ``-inf``.

    Raises:
        NotImplementedError: FlashMLA options the reference does not implement (sparse indices,
            FP8 caches ...).
        ValueError: the cache has more than one KV head, or a sequence needs a ``-1`` block.
    """
    if any(value is not None and value is not False for value in unsupported.values()):
        raise NotImplementedError(f"reference FlashMLA: {', '.join(sorted(unsupported))} not supported")
    if k_cache.shape[-2] != 1:
        raise ValueError(f"reference FlashMLA: latent cache with {k_cache.shape[-2]} KV heads (want 1)")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    batch, seqlen_q, heads, _ = q.shape
    out = torch.zeros(batch, seqlen_q, heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    lengths = cache_seqlens.tolist()
    for i in range(min(batch, len(lengths))):
        if lengths[i] <= 0:
            continue
        latents = gather_paged(k_cache, block_table[i], lengths[i])  # [L, 1, D]
        out[i], lse[i] = attend_sequence(q[i], latents, latents[..., :head_dim_v], scale, causal)
    return out, lse


#: ``linear_kv_up_proj`` -> the KV norm its layer applies before it, for layers built from
#: megatron-core's local spec, which keeps that norm in ``kv_layernorm`` (TE fuses it into the linear).
_KV_NORMS: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()


def register_kv_norm(linear: torch.nn.Module, norm: torch.nn.Module) -> None:
    """Record that ``norm`` (an MLA layer's ``kv_layernorm``) is the KV norm applied before
    ``linear`` (its ``linear_kv_up_proj``), for :func:`split_norm_linear`. Held weakly."""
    _KV_NORMS[linear] = norm


def split_norm_linear(fused_layer: Any, config: Any, init_method: Any = None, tp_group: Any = None) -> tuple[Any, Any]:
    """Stand-in for TE's ``split_te_layernorm_column_parallel_linear`` on the local layer spec.

    ``prepare_for_absorption`` asks for ``linear_kv_up_proj`` as ``(norm, linear)`` and makes the
    norm the layer's ``kv_layernorm``. The local spec's KV up-projection is a plain
    ``ColumnParallelLinear`` whose norm already is ``kv_layernorm`` (as :func:`register_kv_norm`
    recorded it; without query/key norms an ``IdentityOp``, what ``kv_layernorm`` then is). Like
    TE's split, the answer is two new modules holding copies of the weights (:func:`copied`), so
    the KV up-projection ends in two unlinked copies as on a GPU (fault M1 shows on the CPU too)
    and the latent cache holds the normalized compressed KV, as with TE's fused layer.

    Raises:
        NotImplementedError: ``config.qk_layernorm`` is set and no norm was registered for
            ``fused_layer``: an identity in place of the layer's KV norm would change the model.
    """
    norm = _KV_NORMS.get(fused_layer)
    if norm is None:
        if getattr(config, "qk_layernorm", False):
            raise NotImplementedError(
                "MLA with qk_layernorm and cache_mla_latents: the KV norm of this linear_kv_up_proj is unknown "
                "(megatron_ext.cpu_backend.mla.register_kv_norm records it for megatron-ext's MLA layers)")
        from .. import mcore

        norm = mcore.import_module("megatron.core.transformer.identity_op").IdentityOp()
    return copied(norm), copied(fused_layer)


def copied(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` with parameters of its own holding copies of the values (what
    TE's split builds; a deep copy would try to copy the process groups the module holds)."""
    twin = copy.copy(module)
    twin._parameters = {name: None if p is None else torch.nn.Parameter(p.detach().clone(), p.requires_grad)
                        for name, p in module._parameters.items()}
    return twin


class ReferenceMLACoreAttention(torch.nn.Module):
    """Core attention of an MLA layer for a forward without an inference context, in plain torch.

    The local spec's ``DotProductAttention`` takes no ``k_channels`` / ``v_channels``, which
    ``MultiLatentAttention`` passes (queries and keys have ``qk_head_dim + qk_pos_emb_head_dim``
    channels, values ``v_head_dim``). This module takes them and computes causal self-attention
    with :func:`~megatron_ext.cpu_backend.attention.attend_sequence`, the reference kernels'
    arithmetic. The engine's dynamic steps never call it (they go through
    ``flash_decode_and_prefill``).

    Constructor arguments are those ``MultiLatentAttention`` builds its core attention with; only
    ``attn_mask_type`` and ``softmax_scale`` (None: ``k_channels ** -0.5``) are used.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, **unused: Any) -> None:
        super().__init__()
        self.config = config
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or 1) ** -0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None,
                **unused: Any) -> torch.Tensor:
        """Causal attention of full sequences.

        Args:
            query, key: ``[s, b, h, dk]``; value: ``[s, b, h, dv]``; any float dtype.
            attention_mask: ignored (the mask type is causal).
            attn_mask_type: None (the module's) or causal.

        Returns:
            ``[s, b, h * dv]`` in ``query.dtype``.

        Raises:
            NotImplementedError: a non-causal mask type, an attention bias, packed sequences, or
                keys not as long as the queries (no KV cache here).
        """
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if (getattr(mask_type, "name", None) != "causal" or attention_bias is not None
                or packed_seq_params is not None or key.shape[0] != query.shape[0]):
            raise NotImplementedError("reference MLA core attention: causal self-attention over full "
                                      "sequences only (no bias, no packed sequences)")
        seqlen, batch, heads, _ = query.shape
        out = torch.empty(seqlen, batch, heads * value.shape[-1], dtype=query.dtype, device=query.device)
        for i in range(batch):
            attended, _ = attend_sequence(query[:, i], key[:, i], value[:, i], self.softmax_scale, causal=True)
            out[:, i] = attended.reshape(seqlen, -1)
        return out


@contextlib.contextmanager
def mla_on_cpu() -> Iterator[None]:
    """Within the block megatron-core's MLA dynamic inference calls the stand-ins above.

    Replaces ``flash_mla_with_kvcache`` and ``get_mla_metadata`` in
    ``megatron.core.transformer.attention`` and ``split_te_layernorm_column_parallel_linear`` in
    ``megatron.core.transformer.multi_latent_attention``; puts the originals back on exit.

    Raises:
        megatron_ext.errors.MegatronCoreNotFoundError: megatron-core is not importable.
    """
    from .. import mcore

    attention = mcore.import_module(ATTENTION_MODULE)
    mla = mcore.import_module(MLA_MODULE)
    swap = AttributeSwap()
    try:
        swap.set(attention, "flash_mla_with_kvcache", flash_mla_attention)
        swap.set(attention, "get_mla_metadata", mla_metadata)
        swap.set(mla, "split_te_layernorm_column_parallel_linear", split_norm_linear)
        yield
    finally:
        swap.restore()
