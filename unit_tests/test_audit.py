"""``ContextAudit``'s block-table and prefix-chain checks (faults 3-5) on a real context.

Each test puts the books of a 4-block LRU context into the state the fault leaves behind, the
way the fault does it (same tensors, same hash map), and checks the audit names it: exact kind,
step, block and text. The audit is independent of the runtime patches, so these run unpatched.
"""

from __future__ import annotations

import torch

from megatron_ext.harness.audits import FAULT_OF_KIND, ContextAudit
from megatron_ext.patches.lru_leaf_first_eviction import prefix_forest

from .test_lru_faults import A, B, four_block_lru_context, retire_all
from .context_factory import make_request


def audited(ctx) -> ContextAudit:
    return ContextAudit(ctx).attach()


def kinds(audit: ContextAudit) -> list[tuple[str, int, int, int]]:
    return [(v.kind, v.step, v.block, v.request_id) for v in audit.violations]


def test_clean_step_has_no_violation():
    with four_block_lru_context() as ctx:
        audit = audited(ctx)
        ctx.add_request(make_request(7, A))
        audit.end_step()
        assert audit.violations == []
        assert audit.summary().lru_violations == 0


def test_a_block_id_twice_in_a_live_block_table_is_fault_4():
    with four_block_lru_context() as ctx:
        audit = audited(ctx)
        ctx.add_request(make_request(7, A))  # block table [2, 3]
        ctx.request_to_kv_block_ids[0, 1] = 2  # what fault 4 leaves: a matched block handed back
        ctx.kv_block_allocator.block_ref_counts[2] += 1
        ctx.kv_block_allocator.block_ref_counts[3] -= 1
        audit.end_step()
        assert ("block_table", 0, 2, 7) in kinds(audit)
        line = next(v.detail for v in audit.violations if v.kind == "block_table")
        assert line == "request 7's block table holds block 2 2 times"
        assert audit.summary().lru_violations == 1
        assert FAULT_OF_KIND["block_table"] == "fault 4 (lru-pin-before-allocate)"


def test_a_cached_block_whose_parent_is_gone_is_fault_3():
    with four_block_lru_context() as ctx:
        audit = audited(ctx)
        ctx.add_request(make_request(7, A))  # [2, 3], parent 2 -> child 3
        retire_all(ctx)
        audit.end_step()
        assert audit.violations == []
        # The released 0.17/0.18 eviction takes the parent (lower ID on a timestamp tie).
        ctx.kv_block_allocator._deregister_blocks(torch.tensor([2]))
        audit.end_step()
        # (0.19's prefix forest also still names block 2 as block 3's parent: a child_count
        # violation on block 2 follows there.)
        assert kinds(audit)[0] == ("prefix_chain", 1, 3, -1)
        assert audit.summary().violations_by_kind["prefix_chain"] == 1
        assert audit.violations[0].detail == (
            "cached block 3 outlived its parent block: a lookup of its prefix raises KeyError")
        assert FAULT_OF_KIND["prefix_chain"] == "fault 3 (lru-leaf-first-eviction)"


def test_a_child_counted_twice_is_fault_5():
    with four_block_lru_context() as ctx:
        audit = audited(ctx)
        ctx.add_request(make_request(7, B))
        allocator = ctx.kv_block_allocator
        parent_id, child_count = prefix_forest(allocator)  # 0.17/0.18 unpatched: made here
        parent_id[torch.tensor([2, 3])] = torch.tensor([-1, 2])
        child_count[2] = 2  # block 3 registered twice by 0.19's register_kv_block_hashes
        audit.end_step()
        assert kinds(audit) == [("child_count", 0, 2, -1)]
        assert audit.violations[0].detail == (
            "block 2 counts 2 cached children but 1 registered blocks name it parent: it can never "
            "be evicted, yet counts as evictable")
        assert audit.summary().violations_by_kind == {"child_count": 1}
