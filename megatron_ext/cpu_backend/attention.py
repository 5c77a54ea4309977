"""Reference paged attention in plain torch, in place of the flash-attention kernels.

megatron-core's dynamic inference calls two flash-attention 2 entry points that
``megatron.core.transformer.attention`` imports by name: ``flash_attn_varlen_func`` (with
``block_table``) for steps that contain a prefill, and ``flash_attn_with_kvcache`` for decode-only
steps. :func:`reference_attention` installs :func:`varlen_attention` and :func:`kvcache_attention`
under those names, answers the module's flash-attn version check, and hides FA3/FA4 so the FA2
call signatures are the ones used.

Numerics: every query token is computed on its own, in float32, against exactly the keys it may
see, with op shapes that depend only on its position in its sequence. So a token's output does
not depend on which other requests share the batch, nor on how many query tokens of its own
request are in the step (a full prefill, a chunk, a prefix-cached partial prefill or a decode
step all give the same bits). This is slower than a batched kernel; it is a reference.

Layouts follow flash-attn: ``q`` is ``[tokens, heads, head_dim]`` (varlen) or
``[batch, seqlen_q, heads, head_dim]`` (kvcache); a paged cache is
``[num_blocks, block_size, kv_heads, head_dim]``; query head ``h`` reads kv head
``h // (heads // kv_heads)`` (grouped-query attention); causal masks are aligned to the bottom
right (query ``i`` of ``Lq`` sees keys ``j <= i + Lk - Lq``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch
from packaging.version import Version

from ._swap import AttributeSwap

#: Module whose flash-attention names are replaced.
ATTENTION_MODULE = "megatron.core.transformer.attention"

#: flash-attn release whose interface the reference implements; the answer to version checks.
REFERENCE_FA_VERSION = "2.7.4.post1"

Window = tuple[int, int]


def _check_unsupported(**features: Any) -> None:
    """Raise NotImplementedError for flash-attn features the reference does not implement."""
    for name, value in features.items():
        # Tensors (ALiBi slopes, new keys) are "set" by being present at all.
        if isinstance(value, torch.Tensor) or value not in (None, 0, 0.0, False):
            shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"reference attention: {name}={shown} is not supported")


def _key_range(position: int, seqlen_k: int, causal: bool, window: Window) -> tuple[int, int]:
    """Half-open range of keys visible to the query at (bottom-right-aligned) ``position``."""
    left, right = window
    if causal:
        right = 0  # flash-attn: a causal mask is a window with no keys to the right
    hi = seqlen_k if right < 0 else min(seqlen_k, position + right + 1)
    lo = 0 if left < 0 else max(0, position - left)
    return lo, hi


def attend_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    window: Window = (-1, -1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence's queries over its keys, one query token at a time.

    Args:
        q: ``[Lq, H, D]`` queries, any float dtype.
        k: ``[Lk, Hkv, D]`` keys of the whole sequence so far (key position 0 first); ``H`` must
            be a multiple of ``Hkv``.
        v: ``[Lk, Hkv, Dv]`` values.
        softmax_scale: multiplier of ``q . k`` before the softmax (usually ``D ** -0.5``).
        causal: bottom-right-aligned causal mask.
        window: flash-attn ``(left, right)`` sliding window; ``-1`` means unbounded.

    Returns:
        ``(out, lse)``: ``out`` ``[Lq, H, Dv]`` in ``q.dtype``; ``lse`` ``[H, Lq]`` float32 natural
        log-sum-exp of the scaled scores. A query that sees no key gets zeros and ``lse = -inf``
        (what flash-attn returns).

    Raises:
        ValueError: ``H`` is not a multiple of ``Hkv``.
    """
    seqlen_q, heads, _ = q.shape
    seqlen_k, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    group = heads // kv_heads
    # Fresh float32 copies starting at key 0: every slice below then has an offset and strides
    # that depend only on the query's position, never on the batch or the chunking.
    keys_t = k.to(torch.float32, copy=True).permute(1, 2, 0)  # [Hkv, D, Lk]
    values = v.to(torch.float32, copy=True).permute(1, 0, 2)  # [Hkv, Lk, Dv]
    out = torch.zeros(seqlen_q, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((heads, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    for t in range(seqlen_q):
        lo, hi = _key_range(t + seqlen_k - seqlen_q, seqlen_k, causal, window)
        if hi <= lo:
            continue
        query = q[t].to(torch.float32, copy=True).view(kv_heads, group, -1)  # [Hkv, G, D]
        scores = torch.bmm(query, keys_t[:, :, lo:hi]) * softmax_scale  # [Hkv, G, n]
        row_max = scores.amax(dim=-1, keepdim=True)
        weights = torch.exp(scores - row_max)
        total = weights.sum(dim=-1, keepdim=True)
        out[t] = (torch.bmm(weights, values[:, lo:hi]) / total).reshape(heads, -1)
        lse[:, t] = (row_max + torch.log(total)).reshape(heads)
    return out.to(q.dtype), lse


def gather_paged(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence, ``[length, Hkv, D]``.

    Raises:
        ValueError: a block the sequence needs is ``-1`` (unallocated) or out of range.
    """
    block_size = cache.shape[1]
    needed = block_ids[: -(-length // block_size)].long()
    if needed.numel() and (bool((needed < 0).any()) or bool((needed >= cache.shape[0]).any())):
        raise ValueError(f"block table row {block_ids.tolist()} lacks a valid block for "
                         f"{length} cached tokens (block size {block_size})")
    return cache.index_select(0, needed).flatten(0, 1)[:length]


def _sequence_kv(k: torch.Tensor, v: torch.Tensor, block_table: Optional[torch.Tensor],
                 index: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of sequence ``index``: from the paged cache, or packed at ``start``."""
    if block_table is None:
        return k[start:start + length], v[start:start + length]
    return (gather_paged(k, block_table[index], length),
            gather_paged(v, block_table[index], length))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
) -> Any:
    """Stand-in for ``flash_attn.flash_attn_varlen_func`` (flash-attn 2 signature).

    Args:
        q: ``[total_q, H, D]`` packed queries; rows past ``cu_seqlens_q[-1]`` are padding.
        k, v: with ``block_table``: paged caches ``[num_blocks, block_size, Hkv, D]``; without:
            packed ``[total_k, Hkv, D]``.
        cu_seqlens_q: ``[B + 1]`` int32 cumulative query lengths.
        cu_seqlens_k: ``[B + 1]`` int32 cumulative key lengths (each sequence's full length).
        max_seqlen_q, max_seqlen_k: upper bounds; not needed by the reference.
        softmax_scale: defaults to ``D ** -0.5``.
        causal, window_size: as in flash-attn (bottom-right-aligned causal mask).
        return_attn_probs: if True also return the ``[H, total_q]`` float32 log-sum-exp (and
            ``None`` for the probabilities), as flash-attn does.
        block_table: ``[B, max_blocks]`` int32 block ids; ``-1`` past each sequence's blocks.
        dropout_p, softcap, alibi_slopes: must be 0 / None.

    Returns:
        ``out`` ``[total_q, H, Dv]`` in ``q.dtype`` (padding rows zero), or
        ``(out, lse, None)`` when ``return_attn_probs``.

    Raises:
        NotImplementedError: dropout, softcap or ALiBi requested.
        ValueError: a sequence needs a ``-1`` block, or heads are not a multiple of kv heads.
    """
    _check_unsupported(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q_lo, q_hi = cu_q[i], cu_q[i + 1]
        if q_hi <= q_lo:
            continue
        keys, values = _sequence_kv(k, v, block_table, i, cu_k[i], cu_k[i + 1] - cu_k[i])
        out[q_lo:q_hi], lse[:, q_lo:q_hi] = attend_sequence(
            q[q_lo:q_hi], keys, values, scale, causal, tuple(window_size))
    return (out, lse, None) if return_attn_probs else out


def kvcache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """Stand-in for ``flash_attn.flash_attn_with_kvcache`` (flash-attn 2 signature), read-only.

    Args:
        q: ``[B, Sq, H, D]`` queries (``Sq`` new tokens per sequence, already in the cache).
        k_cache, v_cache: with ``block_table``: ``[num_blocks, block_size, Hkv, D]``; without:
            ``[B, max_len, Hkv, D]``.
        cache_seqlens: ``[Bc]`` int32 tokens in each sequence's cache, the new ones included.
            ``Bc`` may differ from ``B`` (megatron-core 0.17 sends padded token rows to this
            kernel when every request of a mixed step has one query token): the first
            ``min(B, Bc)`` rows are computed, the other query rows are zero.
        block_table: ``[Bc, max_blocks]`` int32 block ids, ``-1`` past each sequence's blocks.
        softmax_scale: defaults to ``D ** -0.5``.
        causal, window_size: as in flash-attn.
        num_splits: ignored (the reference never splits).
        return_softmax_lse: if True also return the ``[B, H, Sq]`` float32 log-sum-exp.
        k, v, rotary_*, cache_batch_idx, cache_leftpad, softcap, alibi_slopes: must be unset;
            the reference only reads the cache.

    Returns:
        ``out`` ``[B, Sq, H, Dv]`` in ``q.dtype``, or ``(out, lse)`` with ``return_softmax_lse``.

    Raises:
        NotImplementedError: an unsupported feature was requested.
        ValueError: ``cache_seqlens`` missing, or a sequence needs a ``-1`` block.
    """
    _check_unsupported(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                       cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                       softcap=softcap, alibi_slopes=alibi_slopes)
    if cache_seqlens is None:
        raise ValueError("kvcache_attention: cache_seqlens is required")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    batch, seqlen_q, heads, _ = q.shape
    out = torch.zeros(batch, seqlen_q, heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    lengths = cache_seqlens.tolist()
    for i in range(min(batch, len(lengths))):
        if lengths[i] <= 0:
            continue
        if block_table is None:
            keys, values = k_cache[i, : lengths[i]], v_cache[i, : lengths[i]]
        else:
            keys, values = _sequence_kv(k_cache, v_cache, block_table, i, 0, lengths[i])
        out[i], lse[i] = attend_sequence(q[i], keys, values, scale, causal, tuple(window_size))
    return (out, lse) if return_softmax_lse else out


def fa_version_answer(version: str, check_equality: bool = True) -> bool:
    """Stand-in for megatron-core's ``is_fa_min_version``: the reference acts as flash-attn
    :data:`REFERENCE_FA_VERSION`. Returns True when that release is >= ``version``
    (``>`` when ``check_equality`` is False)."""
    have, want = Version(REFERENCE_FA_VERSION), Version(version)
    return have >= want if check_equality else have > want


def _replacements() -> dict[str, Any]:
    """Attribute of ``megatron.core.transformer.attention`` -> value installed while enabled."""
    return {
        "flash_attn_varlen_func": varlen_attention,
        "flash_attn_with_kvcache": kvcache_attention,
        "is_fa_min_version": fa_version_answer,
        # Hide FA3/FA4 (if the release knows them) so the FA2 signatures above are called.
        "HAVE_FA3": False,
        "HAVE_FA4": False,
    }


@contextlib.contextmanager
def reference_attention() -> Iterator[None]:
    """Within the block, megatron-core's attention calls the reference kernels above.

    Replaces ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``, ``is_fa_min_version``
    (and sets ``HAVE_FA3`` / ``HAVE_FA4`` to False where present) in
    ``megatron.core.transformer.attention``; puts the original objects back on exit.

    Raises:
        megatron_ext.errors.MegatronCoreNotFoundError: megatron-core is not importable.
    """
    from .. import mcore

    module = mcore.import_module(ATTENTION_MODULE)
    swap = AttributeSwap()
    try:
        for name, value in _replacements().items():
            if name.startswith("HAVE_") and not hasattr(module, name):
                continue  # a release without that flash-attn generation
            swap.set(module, name, value)
        yield
    finally:
        swap.restore()


# --- the training forward's attention, computed like the engine's -----------------------------

#: Module and class of megatron-core's local (non-Transformer-Engine) core attention, the one the
#: training forward of a ``GPTModel`` with the local layer spec calls.
DOT_PRODUCT_ATTENTION_MODULE = "megatron.core.transformer.dot_product_attention"


def full_sequence_attention(
    core_attention: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    attn_mask_type: Any = None,
    attention_bias: Optional[torch.Tensor] = None,
    packed_seq_params: Any = None,
) -> torch.Tensor:
    """Stand-in for ``DotProductAttention.forward`` with the reference kernels' arithmetic.

    Each sequence of the batch goes through :func:`attend_sequence` (causal), the function the
    engine's paged prefill and decode calls reach through :func:`varlen_attention` and
    :func:`kvcache_attention`: per query token, float32 scores against keys ``0..t``, the same
    max-subtracted softmax and the same weighted sum of values. A query's output then has the bits
    the engine computed for that token, whether the engine read its keys from the paged cache in a
    prefill, a prefix-cached partial prefill or a decode step. The softmax scale is
    ``head_dim ** -0.5``, what megatron-core passes to flash-attention (``DotProductAttention``'s own
    ``1 / sqrt(head_dim)`` may differ from it in the last bit).

    Args:
        core_attention: the ``DotProductAttention`` module (its own bound ``self``).
        query: ``[sq, b, np, hn]``; key, value: ``[sk, b, ng, hn]`` with ``sk == sq`` (training
            forward: the full sequences, no KV cache); any float dtype.
        attention_mask: must be None (causal attention over right-padded sequences: a token never
            sees the padding after it).
        attn_mask_type: must be causal (or None: the module's own, causal for GPT self-attention).
        attention_bias, packed_seq_params: must be None.

    Returns:
        ``[sq, b, np * hn]`` in ``query.dtype``, the layout ``DotProductAttention`` returns.

    Raises:
        NotImplementedError: a mask, attention bias, packed sequences, a non-causal mask type,
            ``sk != sq`` or a softmax scale set in the config (the engine's kernels do not use it).
    """
    mask_type = attn_mask_type if attn_mask_type is not None else core_attention.attn_mask_type
    if (attention_mask is not None or attention_bias is not None or packed_seq_params is not None
            or getattr(mask_type, "name", None) != "causal" or key.shape[0] != query.shape[0]
            or core_attention.config.softmax_scale is not None):
        raise NotImplementedError(
            "matched training attention: only causal self-attention over full sequences without a "
            "mask, bias, packed sequences or config.softmax_scale")
    seqlen, batch, heads, head_dim = query.shape
    scale = head_dim ** -0.5  # as megatron-core's flash-attention calls compute it
    out = torch.empty(seqlen, batch, heads * value.shape[-1], dtype=query.dtype, device=query.device)
    for i in range(batch):
        attended, _ = attend_sequence(query[:, i], key[:, i], value[:, i], scale, causal=True)
        out[:, i] = attended.reshape(seqlen, -1)
    return out


@contextlib.contextmanager
def matched_training_attention() -> Iterator[None]:
    """Within the block, megatron-core's ``DotProductAttention`` (the training forward's core
    attention with the local layer spec) computes like the reference paged attention
    (:func:`full_sequence_attention`). Opt-in: ``ab --trainer-logprobs matched`` switches it on
    around the trainer forward only; the class's own ``forward`` is back on exit.

    Raises:
        megatron_ext.errors.MegatronCoreNotFoundError: megatron-core is not importable.
    """
    from .. import mcore

    module = mcore.import_module(DOT_PRODUCT_ATTENTION_MODULE)
    swap = AttributeSwap()
    try:
        swap.set(module.DotProductAttention, "forward", full_sequence_attention)
        yield
    finally:
        swap.restore()
