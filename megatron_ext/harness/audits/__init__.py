"""The audits ``ab`` and ``soak`` run on every step, one module per invariant.

* :mod:`.kv_writes`: no KV write into a block the writer did not allocate (fault 2);
* :mod:`.ref_counts`: ref counts equal live owners, a clean free pool, a complete drain (fault 1);
* :mod:`.lru`: block tables without a repeated ID, whole prefix chains, child counts (faults 3-5);
* :mod:`.stale_hits`: no hash match of a block cached under older weights (fault 8);
* :mod:`.mamba_snapshots`: hybrid models: no prefill token skipped without its Mamba state
  restored (fault H1); every ``restore_to_live`` recorded;
* :mod:`.pool`: KV pool pressure and prefix-cache counters (measured, not checked);
* :mod:`.context`: :class:`ContextAudit`, which attaches them to a context, detaches them, and
  returns typed summaries; :mod:`.base`: :class:`Violation`, :data:`FAULT_OF_KIND`.

A new audit is a module here, fed by :class:`ContextAudit` and counted in :class:`AuditSummary`.
"""

from .base import FAULT_OF_KIND, Violation, free_blocks, pool_blocks
from .context import AuditSummary, ContextAudit
from .pool import PoolPressure, PrefixCacheCounters

__all__ = ["FAULT_OF_KIND", "AuditSummary", "ContextAudit", "PoolPressure", "PrefixCacheCounters", "Violation",
           "free_blocks", "pool_blocks"]
