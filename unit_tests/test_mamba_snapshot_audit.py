"""The Mamba snapshot audit (``megatron_ext/harness/audits/mamba_snapshots.py``) on a real hybrid
context: fault H1's trigger (test_mamba_clamp_restore.py) with ``ContextAudit`` attached.

r0's 48-token prompt is registered, blocks 1 and 2 get Mamba snapshots, and r1 = r0's first 33
tokens is added whole. Released 0.18 / 0.19: the clamp leaves a 16-token skip on block 0, which
has no snapshot; ``restore_to_live`` fails and the audit must record it and flag it (one
violation). Patched (``mamba-clamp-restore``): r1 skips nothing, no restore, no violation. 0.17
has no clamp: r1 skips 32 and restores block 1's snapshot, which the audit records as a success.
With ``MEGATRON_EXT_TEST_UNPATCHED=1``, ``test_patched_context_passes_the_audit`` fails on 0.18.x
and 0.19.x (2 of its parametrizations), passes on 0.17.x.
"""

from __future__ import annotations

import types

import megatron_ext
from megatron_ext import mcore
from megatron_ext.harness.audits import FAULT_OF_KIND, ContextAudit
from megatron_ext.harness.audits.base import AuditLog
from megatron_ext.harness.audits.mamba_snapshots import MambaRestore, MambaSnapshotAudit

from .context_factory import block_table, make_request, prefix_caching_context
from .hybrid_context_factory import (
    cache_mamba_state, engine_mamba_match, hybrid_prefix_caching_context, run_pending_mamba_ops,
)

SERIES = mcore.release_series(mcore.installed_version())
PROMPT = list(range(100, 164))


def audit_h1_trigger(policy: str = "REF_ZERO") -> tuple[list[int], ContextAudit]:
    """r0 (48 tokens, snapshots after blocks 1 and 2), then r1 = its first 33 tokens, through an
    attached ``ContextAudit``; one engine step ends after r1's deferred Mamba ops ran. Returns r0's
    block IDs and the (detached) audit."""
    with hybrid_prefix_caching_context(policy) as context:
        audit = ContextAudit(context).attach()
        try:
            context.add_request(make_request(1, PROMPT[:48]))
            run_pending_mamba_ops(context)
            audit.end_step()
            blocks = block_table(context, 0, 3)
            cache_mamba_state(context, [blocks[1], blocks[2]])
            r1 = make_request(2, PROMPT[:33])
            engine_mamba_match(context, r1)
            context.add_request(r1)
            run_pending_mamba_ops(context)
            audit.end_step()
        finally:
            audit.detach()
        assert "restore_to_live" not in vars(context.mamba_slot_allocator)  # detach removed the wrapper
        return blocks, audit


def test_released_code_fails_the_restore_and_the_audit_flags_it():
    megatron_ext.revert()  # the released code, whatever the run mode
    blocks, audit = audit_h1_trigger()
    summary = audit.summary()
    if SERIES == "0.17":  # no clamp: r1 skips 32 and restores block 1's snapshot
        assert audit.mamba.restores == [MambaRestore(1, 2, blocks[1], 32, True)]
        assert audit.violations == [] and summary.mamba_restore_violations == 0
        return
    assert audit.mamba.restores == [MambaRestore(1, 2, blocks[0], 16, False)]
    assert [(v.kind, v.step, v.block, v.request_id) for v in audit.violations] == [
        ("mamba_restore", 1, blocks[0], 2)]
    assert audit.violations[0].detail == (
        f"request 2 skipped 16 prefill tokens but restore_to_live found no Mamba snapshot in block "
        f"{blocks[0]}: its Mamba layers start from a zero state")
    assert (summary.mamba_restores, summary.mamba_restores_failed, summary.mamba_restore_violations) == (1, 1, 1)
    assert summary.mamba_restore_log == [
        {"step": 1, "request_id": 2, "block": blocks[0], "tokens_skipped": 16, "restored": False}]
    assert FAULT_OF_KIND["mamba_restore"] == "fault H1 (mamba-clamp-restore)"


def test_patched_context_passes_the_audit(runtime_patches_either_order):
    blocks, audit = audit_h1_trigger()
    if SERIES == "0.17":
        assert audit.mamba.restores == [MambaRestore(1, 2, blocks[1], 32, True)]
    else:  # mamba-clamp-restore: no snapshot at or before the clamped skip, so nothing is skipped
        assert audit.mamba.restores == []
    assert audit.violations == []
    assert audit.summary().mamba_restore_violations == 0


def test_skip_without_any_restore_is_a_violation_at_the_end_of_the_step():
    log = AuditLog(types.SimpleNamespace())
    audit = MambaSnapshotAudit(log)
    audit.begin_add_request(5)
    audit.end_add_request(5, first_chunk=True, skipped=32)
    audit.begin_add_request(6)
    audit.end_add_request(6, first_chunk=False, skipped=16)  # a later chunk continues its live state
    audit.end_step()
    assert [(v.kind, v.step, v.block, v.request_id, v.detail) for v in log.violations] == [
        ("mamba_restore", 0, -1, 5, "request 5 skipped 32 prefill tokens and no Mamba state was restored")]


def test_restore_inside_add_request_is_settled_with_its_skip():
    # 0.17 restores inside add_request, before the audit knows the skip: recorded at its end
    log = AuditLog(types.SimpleNamespace())
    audit = MambaSnapshotAudit(log)
    audit.begin_add_request(5)
    audit.restore_called(0, 9, True)
    audit.end_add_request(5, first_chunk=True, skipped=32)
    audit.end_step()
    assert audit.restores == [MambaRestore(0, 5, 9, 32, True)] and log.violations == []


def test_gpt_prefix_hits_are_not_mamba_violations():
    # a GPT context has no Mamba slot allocator: its skips need no restore
    with prefix_caching_context() as context:
        audit = ContextAudit(context).attach()
        context.add_request(make_request(1, PROMPT[:48]))
        context.add_request(make_request(2, PROMPT[:40]))  # 2 blocks matched, 32 tokens skipped
        audit.end_step()
        audit.detach()
    assert audit.counters.prefill_tokens_skipped == 32
    assert audit.violations == [] and audit.mamba.restores == []
