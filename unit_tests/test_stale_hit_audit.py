"""The stale-hit audit (fault 8) on a real ``DynamicInferenceContext`` on the CPU, both policies.

No runtime patch is applied (the audit must see what released megatron-core does): after
``ContextAudit.weights_updated()`` nothing invalidates the prefix cache, so a request admitted
afterwards matches the blocks cached before, and the audit must name each one. Prompt A is two
full blocks of 16 tokens; the second request asks A plus one token, so it matches both blocks.
"""

from __future__ import annotations

import pytest

import megatron_ext
from megatron_ext.harness.audits import FAULT_OF_KIND, ContextAudit

from .context_factory import block_table, finish_chunk, make_request, prefix_caching_context

A = list(range(1000, 1032))
C = list(range(3000, 3016))


@pytest.fixture(params=["REF_ZERO", "LRU"])
def ctx(request):
    megatron_ext.revert()
    with prefix_caching_context(request.param) as context:
        yield context


def stale(audit: ContextAudit) -> list[tuple[str, int, int, int]]:
    return [(v.kind, v.step, v.block, v.request_id) for v in audit.violations if v.kind == "stale_hit"]


def test_a_match_of_blocks_cached_before_the_update_is_a_stale_hit(ctx):
    audit = ContextAudit(ctx).attach()
    ctx.add_request(make_request(1, A))
    first = block_table(ctx, 0, 2)
    audit.end_step()
    audit.weights_updated()
    ctx.add_request(make_request(2, A + [7]))
    assert block_table(ctx, 1, 2) == first  # matched, not recomputed into new blocks
    assert stale(audit) == [("stale_hit", 1, first[0], 2), ("stale_hit", 1, first[1], 2)]
    assert audit.violations[0].detail == (
        f"request 2 (admitted at weight version 1) matched block {first[0]}, cached at weight version 0; "
        "the weights are at version 1")
    assert audit.summary().stale_hits == 2
    assert audit.summary().violations_by_kind == {"stale_hit": 2}
    assert FAULT_OF_KIND["stale_hit"] == "fault 8 (weight-update-invalidation)"
    audit.detach()


def test_matches_within_one_weight_version_are_not_stale(ctx):
    audit = ContextAudit(ctx).attach()
    ctx.add_request(make_request(1, A))
    ctx.add_request(make_request(2, A + [7]))  # same version: an ordinary cache hit
    audit.weights_updated()
    ctx.add_request(make_request(3, C))  # registered at version 1
    ctx.add_request(make_request(4, C + [7]))  # matches block of request 3: version 1, not stale
    assert audit.kv_writes.last_matched == block_table(ctx, 2, 1)
    assert stale(audit) == []
    assert audit.summary().stale_hits == 0
    audit.detach()


def test_blocks_registered_after_the_update_by_a_request_admitted_before_it_are_stale(ctx):
    """A chunked prefill straddling the update: its later chunks attend to the old weights' KV,
    so the blocks they register carry the request's version (0), not the current one."""
    audit = ContextAudit(ctx).attach()
    straddling = make_request(1, A + C)  # 48 tokens, three blocks
    ctx.add_request(straddling, 16)  # first chunk: block 0 at version 0
    finish_chunk(ctx, straddling, 16)
    audit.weights_updated()
    ctx.add_request(straddling, 32)  # blocks 1 and 2 registered after the update
    blocks = block_table(ctx, 0, 3)
    assert audit.stale.block_version == {blocks[0]: 0, blocks[1]: 0, blocks[2]: 0}
    ctx.add_request(make_request(2, A + C + [7]))
    assert stale(audit) == [("stale_hit", 0, b, 2) for b in sorted(blocks)]  # one per block, by ID
    audit.detach()


def test_no_match_no_stale_hit_and_detach_removes_the_register_wrapper(ctx):
    audit = ContextAudit(ctx).attach()
    allocator = ctx.kv_block_allocator
    assert "register_kv_block_hashes" in allocator.__dict__
    audit.weights_updated()
    audit.weights_updated()
    ctx.add_request(make_request(1, A))
    assert audit.stale.version == 2 and audit.stale.request_version == {1: 2}
    assert stale(audit) == []
    audit.detach()
    assert "register_kv_block_hashes" not in allocator.__dict__
    assert "add_request" not in ctx.__dict__
