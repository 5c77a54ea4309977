"""The routing-replay audit on hand-built steps: each broken replay is named, a correct one is not.

Blocks of 4 tokens, 1 MoE layer, top-2. A "context" here holds only what the audit reads of
megatron-core's ``DynamicInferenceContext`` at ``store_routing_per_block``: the step's active
tokens (request row, position, token ID, KV block and offset), the request IDs and block tables.
Request 7 computes 8 tokens into blocks 3 and 5 and finishes (the engine rebuilds its routing);
request 9 matches both blocks (same 8 tokens) and replays them.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from megatron_ext.harness.audits.base import AuditLog
from megatron_ext.harness.audits.routing_replay import RoutingReplayAudit

BLOCK = 4
DUMMY = 15
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
#: request 7's experts per position: [[e0, e1]] (1 layer, top-2)
EXPERTS = [[[p % 4, (p + 1) % 4]] for p in range(8)]


def _context(rows: list[tuple[int, list[int]]], tokens: list[tuple[int, int, int, int]]):
    """``rows``: (request ID, block table) per row; ``tokens``: (row, position, token ID, block) per
    active token (offset: position % BLOCK)."""
    table = torch.full((len(rows), 4), -1, dtype=torch.int32)
    for row, (_, blocks) in enumerate(rows):
        table[row, : len(blocks)] = torch.tensor(blocks)
    column = lambda i: torch.tensor([t[i] for t in tokens])  # noqa: E731
    return types.SimpleNamespace(
        active_token_count=len(tokens), request_ids=torch.tensor([r for r, _ in rows]),
        request_to_kv_block_ids=table, token_to_request_idx=column(0), token_to_position_in_request=column(1),
        token_to_input_ids=column(2), token_to_block_idx=column(3),
        token_to_local_position_within_kv_block=column(1) % BLOCK,
        kv_block_allocator=types.SimpleNamespace(dummy_block_idx=DUMMY, total_count=DUMMY + 1, block_routing={}))


def _computed_by_seven(finish: bool = True) -> RoutingReplayAudit:
    """Request 7: blocks 3 and 5 allocated, its 8 prompt tokens forwarded and stored; with
    ``finish`` its routing rebuilt (correctly) as the engine does when it finishes."""
    audit = RoutingReplayAudit(AuditLog(context=None))
    audit.prompt(7, TOKENS)
    audit.allocated([3, 5])
    ctx = _context([(7, [3, 5])], [(0, p, TOKENS[p], 3 if p < 4 else 5) for p in range(8)])
    audit.stored(ctx, np.array(EXPERTS, dtype=np.int16))
    if finish:
        audit.reconstructed([3, 5], 8, BLOCK, np.array(EXPERTS))
    return audit


def _nine_matches(audit: RoutingReplayAudit, own: list | None = None, tokens: list[int] = TOKENS) -> None:
    """Request 9 matches blocks 3 and 5 and forwards its last prompt token (position 7) itself,
    with ``own`` experts (request 7's by default); its KV goes to the dummy block (fault 2's fix)."""
    audit.prompt(9, tokens)
    ctx = _context([(9, [3, 5])], [(0, 7, tokens[7], DUMMY)])
    audit.stored(ctx, np.array([own or EXPERTS[7]], dtype=np.int16))


def _details(audit: RoutingReplayAudit) -> list[str]:
    return [v.detail for v in audit.log.violations]


def test_a_matched_prefix_replayed_from_its_blocks_is_clean():
    audit = _computed_by_seven()
    _nine_matches(audit)
    audit.reconstructed([3, 5], 8, BLOCK, np.array(EXPERTS))
    assert _details(audit) == []
    assert (audit.tokens_checked, audit.reconstructions, audit.unidentified) == (16, 2, 0)
    assert audit.tables == {}  # both finished


def test_routing_of_a_reallocated_block_is_stale():
    audit = _computed_by_seven()
    audit.allocated([5])  # block 5 handed out again (released, evicted or flushed) ...
    ctx = _context([(9, [3, 5])], [(0, p, TOKENS[p], 3 if p < 4 else 5) for p in range(3)])
    audit.prompt(9, TOKENS)
    audit.stored(ctx, np.array(EXPERTS[:3], dtype=np.int16))  # ... to request 9, which wrote only 0-2
    audit.reconstructed([3, 5], 8, BLOCK, np.array(EXPERTS))  # the old entries of block 5 replayed
    assert [(v.kind, v.block, v.request_id) for v in audit.log.violations] == [("routing_replay", 5, 9)]
    assert _details(audit) == [
        "request 9 position 4 (block 5, offset 0): replays ((0, 1),), but nothing was stored there while "
        "the request held the block (stale or zero routing)"]


def test_a_finished_request_may_replay_the_life_of_a_block_it_held():
    # fault R2's fix: request 7 finishes, block 5 is allocated again in the same step, and
    # its routing is rebuilt from the block as request 7 held it
    audit = _computed_by_seven(finish=False)
    audit.allocated([5])
    audit.reconstructed([3, 5], 8, BLOCK, np.array(EXPERTS))
    assert _details(audit) == []


def test_a_replay_that_differs_from_what_was_stored_is_named():
    audit = _computed_by_seven()
    _nine_matches(audit)
    replayed = np.array(EXPERTS)
    replayed[2] = [[3, 2]]
    audit.reconstructed([3, 5], 8, BLOCK, replayed)
    assert _details(audit) == [
        "request 9 position 2 (block 3, offset 2): replays ((3, 2),), the last routing stored there is "
        "((2, 3),) (request 7)"]


def test_routing_stored_for_other_tokens_is_named():
    audit = _computed_by_seven()
    other = TOKENS[:5] + [99, 17, 18]  # position 5 differs: block 5 is not request 9's prefix
    _nine_matches(audit, tokens=other)
    audit.reconstructed([3, 5], 8, BLOCK, np.array(EXPERTS))
    assert _details(audit)[0] == ("request 9 position 5 (block 5, offset 1): replays the routing request 7 "
                                  "stored for its position 5, whose tokens up to there differ")


def test_a_replay_that_differs_from_the_own_forward_is_named():
    audit = _computed_by_seven()
    _nine_matches(audit, own=[[2, 0]])  # request 9's own forward of position 7 routed elsewhere
    audit.reconstructed([3, 5], 8, BLOCK, np.array(EXPERTS))
    assert _details(audit) == [
        "request 9 position 7 (block 5, offset 3): replays ((3, 0),), its own forward computed ((2, 0),)"]


def test_no_routing_at_all_is_named():
    audit = _computed_by_seven(finish=False)
    audit.reconstructed([3, 5], 8, BLOCK, None)
    assert [(v.kind, v.block, v.request_id, v.detail) for v in audit.log.violations] == [
        ("routing_missing", 3, 7, "request 7: megatron-core reconstructed no routing from blocks [3, 5] (8 tokens expected)")]


def test_block_routing_larger_than_the_pool_or_on_the_dummy_block_is_named():
    audit = RoutingReplayAudit(AuditLog(context=None))
    allocator = types.SimpleNamespace(dummy_block_idx=DUMMY, total_count=DUMMY + 1,
                                      block_routing={b: None for b in range(DUMMY + 1)})
    audit.end_step(allocator)
    assert _details(audit) == [
        "block_routing holds 16 entries, more than the pool's 15 blocks",
        f"block_routing holds an entry for the dummy block {DUMMY}"]
    assert audit.max_entries == 16
