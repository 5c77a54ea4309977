"""The NumPy views of megatron_ext/patches/views.py keep no bookkeeping tensor alive: a suspend in
RECOMPUTE mode (``deallocate_inference_state_buffers``) deletes every tensor attribute of the
context to free its memory (on 0.17 GPU memory), and the tensors must then be freed."""

from __future__ import annotations

import gc
import weakref

from megatron_ext import mcore

from .context_factory import BLOCK, make_request
from .test_lru_faults import lru_context


def test_recompute_suspend_frees_the_bookkeeping_tensors(runtime_patches_either_order):
    prompt = list(range(10_000, 10_000 + 4 * BLOCK))
    with lru_context(usable_blocks=31, max_tokens=512) as ctx:
        ctx.prefix_cache_lru_clock += 1
        ctx.add_request(make_request(1, prompt))
        ctx.add_request(make_request(2, prompt + [7] * BLOCK))  # a match: views of the tables are made
        names = ("request_to_kv_block_ids", "request_kv_block_counts", "token_to_block_idx")
        alive = {name: weakref.ref(getattr(ctx, name)) for name in names}
        mode = mcore.import_module("megatron.core.inference.config").KVCacheManagementMode
        ctx.kv_cache_management_mode = mode.RECOMPUTE
        ctx.deallocate_inference_state_buffers()
        gc.collect()
        still_alive = sorted(name for name, ref in alive.items() if ref() is not None)
        assert still_alive == [], f"deleted by the suspend but still alive: {still_alive}"
