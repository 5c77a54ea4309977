"""Mamba snapshot audit (hybrid models, fault H1): no prefill token is skipped without its Mamba state.

A hybrid request that skips prompt tokens on a prefix-cache hit must start its Mamba layers from
the state cached at the end of the skipped tokens: megatron-core copies it with
``MambaSlotAllocator.restore_to_live(request_idx, block_id)`` (every release 0.17-0.19: inside
``add_request`` on 0.17, deferred to the next ``initialize_attention_state`` on 0.18 and 0.19).
When that copy fails (the block holds no snapshot), megatron-core zeroes the state but keeps the
skip, so the tokens after it run from a zero state and the output differs from caching off, with
no error (H1: the >= 2-token clamp of 0.18+ moves the skip onto a block without a snapshot).

Every restore attempt is recorded (step, request, block, prompt tokens the request skipped,
success). Violations: a failed restore while tokens of that request are skipped, and a first
prefill chunk that skipped tokens with no restore attempt before the end of its step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .base import AuditLog, Violation


@dataclass(frozen=True)
class MambaRestore:
    """One ``restore_to_live`` call.

    Attributes:
        step: engine step (0-based) of the call.
        request_id: the restored request.
        block: the KV block ID whose Mamba snapshot was asked for.
        tokens_skipped: prompt tokens the request's first prefill chunk skipped (-1: unknown, the
            request was not seen admitted by the audit).
        restored: what ``restore_to_live`` returned (False: no snapshot; the state is zeroed).
    """

    step: int
    request_id: int
    block: int
    tokens_skipped: int
    restored: bool


@dataclass
class MambaSnapshotAudit:
    """Records Mamba state restores and checks them against the tokens skipped (fault H1).

    Attributes:
        log: the context's :class:`AuditLog`.
        restores: every ``restore_to_live`` call, in order.
    """

    log: AuditLog
    restores: list[MambaRestore] = field(default_factory=list)
    #: request ID -> prompt tokens skipped by its latest first chunk
    _skipped: dict[int, int] = field(default_factory=dict)
    #: first chunks that skipped tokens and have not been restored yet: request ID -> (step, skip)
    _awaiting: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: restores made inside the current ``add_request`` (0.17), settled at its end
    _in_call: list[tuple[int, bool]] = field(default_factory=list)
    _adding: Optional[int] = None

    def begin_add_request(self, request_id: int) -> None:
        """An ``add_request`` of ``request_id`` starts."""
        self._adding = request_id
        self._in_call.clear()

    def end_add_request(self, request_id: int, first_chunk: bool, skipped: int) -> None:
        """The ``add_request`` returned; ``skipped``: prompt tokens its chunk did not compute.
        Only a first chunk restores Mamba state (later chunks continue the live state)."""
        self._adding = None
        if first_chunk:
            self._skipped[request_id] = skipped
            if skipped > 0:
                self._awaiting[request_id] = (self.log.step, skipped)
        for block, restored in self._in_call:
            self._record(request_id, block, restored)
        self._in_call.clear()

    def add_request_failed(self) -> None:
        """The ``add_request`` raised (a refused request: megatron-core restores nothing for it)."""
        self._adding = None
        self._in_call.clear()

    def restore_called(self, request_idx: int, block_id: int, restored: bool) -> None:
        """``restore_to_live(request_idx, block_id)`` returned ``restored``."""
        if self._adding is not None:  # 0.17: inside add_request, before its skip is known
            self._in_call.append((int(block_id), bool(restored)))
            return
        self._record(int(self.log.context.request_ids[request_idx]), int(block_id), bool(restored))

    def _record(self, request_id: int, block: int, restored: bool) -> None:
        skipped = self._skipped.get(request_id, -1)
        self.restores.append(MambaRestore(self.log.step, request_id, block, skipped, restored))
        self._awaiting.pop(request_id, None)
        if not restored and skipped > 0:
            self.log.add(Violation(
                "mamba_restore", self.log.step, block, request_id,
                f"request {request_id} skipped {skipped} prefill tokens but restore_to_live found no "
                f"Mamba snapshot in block {block}: its Mamba layers start from a zero state"))

    def end_step(self) -> None:
        """A step ended: a first chunk that skipped tokens must have been restored by now."""
        for request_id, (step, skipped) in self._awaiting.items():
            self.log.add(Violation(
                "mamba_restore", step, -1, request_id,
                f"request {request_id} skipped {skipped} prefill tokens and no Mamba state was restored"))
        self._awaiting.clear()

    def failed(self) -> int:
        """Restore attempts that found no snapshot."""
        return sum(1 for r in self.restores if not r.restored)

    def records(self) -> list[dict[str, Any]]:
        """The restores as JSON-ready dicts (:class:`MambaRestore` fields)."""
        return [asdict(r) for r in self.restores]
