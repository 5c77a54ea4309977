"""Speculative-decoding audit (MTP drafts, ``InferenceConfig.num_speculative_tokens``).

With speculative decoding a decode step forwards, per request, its last sampled token (position
``L - 1`` of its ``L`` accepted tokens, prompt + generated) and ``n`` draft tokens (positions ``L``
to ``L + n - 1``) whose KV lands in the request's blocks before the drafts are verified; the
engine then rolls the rejected ones back (megatron-core's ``rewind_kv_cache``: offsets rewound, a
block holding only rejected drafts released). After every step this audit checks, for every live
request past its prefill:

* ``draft_block``: a block in its block table that is hash-registered (``kv_hash_to_block_id``:
  matchable by another request's ``add_request``) holds only accepted tokens, and its hash is the
  chain hash (megatron-core's ``compute_block_hashes_batched``) of the accepted tokens up to the
  block's end. A block holding a draft, or whose hash names other tokens, would let a request
  sharing the prefix read KV of tokens that were never accepted.
* ``spec_rewind``: the bookkeeping after the rollback is whole: the KV length is ``L - 1``, the
  block table holds exactly the blocks of positions ``0 .. L - 1 + n`` (the next forward's tokens;
  a block past them is a leaked pre-allocation, a missing one a lost block), the last block ID and
  offset point at position ``L - 1 + n``, and no entry past the table's end is left set.

It also counts drafts proposed, accepted and rejected (from the growth of each request's
generated tokens: a decode step that adds ``k`` tokens accepted ``k - 1`` drafts), and the
rejections that crossed a block boundary (a rejected draft in a block after the last kept
position's: the rollback had to drop that block). Ref counts, the free pool, block tables and the
LRU are checked every step by the other audits, speculation or not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Optional

from .base import AuditLog, Violation


@dataclass
class DraftCounts:
    """Drafts over a run.

    Attributes:
        proposed: draft tokens forwarded (``n`` per request per decode step; a request's last
            step may have fewer of them count, see :class:`SpeculativeAudit`).
        accepted: drafts accepted (their KV kept).
        rejected: ``proposed - accepted``.
        rejected_across_block: decode steps where a rejected draft lay in a block after the
            last kept position's block (the rollback crossed a block boundary).
        accepted_across_block: decode steps where an accepted draft lay in a later block than
            the step's first position (accepted KV in a block the drafts opened).
    """

    proposed: int = 0
    accepted: int = 0
    rejected: int = 0
    rejected_across_block: int = 0
    accepted_across_block: int = 0

    def as_json(self) -> dict[str, int]:
        """``{proposed, accepted, rejected, rejected_across_block, accepted_across_block}``: what
        ``ab --json`` (per run and summed) and ``soak`` report."""
        return asdict(self)

    @classmethod
    def total(cls, counts: Iterable["DraftCounts"]) -> "DraftCounts":
        """Every figure summed over ``counts`` (e.g. over the runs of one ``ab``)."""
        out = cls()
        for c in counts:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(c, f.name))
        return out

    def clause(self) -> str:
        """``"5 of 200 drafts accepted"``."""
        return f"{self.accepted} of {self.proposed} draft{'' if self.proposed == 1 else 's'} accepted"

    def none_accepted_warning(self) -> Optional[str]:
        """The report's warning when no draft was accepted (None otherwise): the audit then never
        saw accepted KV in a block the drafts opened, nor a rollback after an acceptance."""
        if self.accepted:
            return None
        return (f"{self.clause()}: a run that accepts no draft proves little about draft blocks (no accepted "
                "draft's KV kept, no rollback after an acceptance); try weights whose drafts the model samples "
                "more often (another seed, or a trained checkpoint)")


@dataclass
class SpeculativeAudit:
    """Checks draft blocks and the rollback's bookkeeping after every step; counts drafts.

    Attributes:
        log: the context's :class:`AuditLog`.
        num_speculative_tokens: the engine's ``n`` (0: speculation off, nothing is checked).
        block_hashes: megatron-core's ``compute_block_hashes_batched(tokens [T] int64, block_size)
            -> list[int]`` (one hash per complete block).
        counts: :class:`DraftCounts` so far.
    """

    log: AuditLog
    num_speculative_tokens: int
    block_hashes: Callable[[Any, int], list]
    counts: DraftCounts = field(default_factory=DraftCounts)
    _requests: dict[int, Any] = field(default_factory=dict)
    _accepted_len: dict[int, int] = field(default_factory=dict)

    def added(self, req: Any) -> None:
        """``add_request`` of ``req`` (the engine's request object; its ``generated_tokens`` grow)."""
        self._requests[req.request_id] = req

    def accepted_tokens(self, request_id: int) -> list[int]:
        """The request's accepted tokens: prompt + generated (drafts not yet verified excluded)."""
        req = self._requests[request_id]
        return list(req.prompt_tokens.tolist()) + list(req.generated_tokens)

    def end_step(self) -> None:
        """After a step: count the drafts, check registered blocks and the rollback."""
        if not self.num_speculative_tokens:
            return
        self._count_drafts()
        ctx = self.log.context
        for row in self.log.live_rows():
            request_id = int(ctx.request_ids[row])
            if request_id not in self._requests or not self._requests[request_id].generated_tokens:
                continue  # in prefill: no draft forwarded yet
            tokens = self.accepted_tokens(request_id)
            self._check_registered(row, request_id, tokens)
            if row >= ctx.paused_request_count:  # paused rows keep their table as it was
                self._check_rollback(row, request_id, len(tokens))

    def _count_drafts(self) -> None:
        n, bs = self.num_speculative_tokens, self.log.context.block_size_tokens
        for request_id, req in self._requests.items():
            length = len(req.prompt_tokens) + len(req.generated_tokens)
            before = self._accepted_len.get(request_id)
            self._accepted_len[request_id] = length
            if before is None or before == len(req.prompt_tokens) or length == before:
                continue  # first sight, its prefill step, or not scheduled
            accepted = min(length - before - 1, n)
            self.counts.proposed += n
            self.counts.accepted += accepted
            self.counts.rejected += n - accepted
            first, kept = before - 1, before - 1 + accepted  # positions forwarded: before-1 .. before-1+n
            if accepted < n and (before - 1 + n) // bs > kept // bs:
                self.counts.rejected_across_block += 1
            if accepted and kept // bs > first // bs:
                self.counts.accepted_across_block += 1

    def _check_registered(self, row: int, request_id: int, tokens: list[int]) -> None:
        ctx = self.log.context
        bs = ctx.block_size_tokens
        # no hash map with prefix caching off
        hash_of_block = {b: h for h, b in getattr(ctx.kv_block_allocator, "kv_hash_to_block_id", {}).items()}
        expected = None
        for index, block in enumerate(self.log.block_table(row)):
            if block not in hash_of_block:
                continue
            end = (index + 1) * bs
            if end > len(tokens):
                self.log.add(Violation(
                    "draft_block", self.log.step, block, request_id,
                    f"block {block} (entry {index} of request {request_id}, positions {index * bs}-{end - 1}) "
                    f"is hash-registered but holds {end - len(tokens)} positions past the request's "
                    f"{len(tokens)} accepted tokens (drafts or nothing)"))
                continue
            if expected is None:
                import torch

                expected = self.block_hashes(torch.tensor(tokens, dtype=torch.int64), bs)
            if hash_of_block[block] != expected[index]:
                self.log.add(Violation(
                    "draft_block", self.log.step, block, request_id,
                    f"block {block} (entry {index} of request {request_id}) is registered under a hash "
                    "that is not the chain hash of the accepted tokens it holds"))

    def _check_rollback(self, row: int, request_id: int, length: int) -> None:
        ctx = self.log.context
        bs, last = ctx.block_size_tokens, length - 1 + self.num_speculative_tokens
        count = int(ctx.request_kv_block_counts[row])
        table = ctx.request_to_kv_block_ids[row].tolist()
        found = {"KV length": int(ctx.request_kv_length_offsets[row]), "blocks": count,
                 "last block offset": int(ctx.request_last_kv_block_offset[row]),
                 "last block": int(ctx.request_last_kv_block_id[row]),
                 "entries set past the table": sum(1 for b in table[count:] if b >= 0)}
        want = {"KV length": length - 1, "blocks": last // bs + 1, "last block offset": last % bs,
                "last block": table[count - 1] if count else -1, "entries set past the table": 0}
        wrong = [f"{k} {found[k]} (expected {want[k]})" for k in want if found[k] != want[k]]
        if wrong:
            self.log.add(Violation(
                "spec_rewind", self.log.step, found["last block"], request_id,
                f"request {request_id} with {length} accepted tokens, next forward up to position {last}: "
                + ", ".join(wrong)))
