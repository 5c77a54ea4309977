"""Per-request books of the ``weight-update-invalidation`` patch (fault 8), kept beside the request.

The books live in a :class:`~.request_state.RequestSideTable`, not in the request's ``__dict__``
(``serialize()`` copies that). A *weight version* is a context's prefix-cache epoch: the number of weight
updates (flushes) that context has seen; version 0 is the weights it started with.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ..errors import MegatronExtError
from .request_state import RequestSideTable


class WeightVersionsNotRecorded(MegatronExtError):
    """The request's weight versions were not recorded (the message says why)."""


@dataclass(eq=False)
class RequestBooks:
    """What the patch knows of one request object.

    Attributes:
        prefill_epoch: the context epoch in which the request's current prefill began (its first
            chunk, or its start over after an eviction); None when it began before the patch saw it
            (before ``apply()``, or while reverted): older than any update.
        context: a weak reference to the context that runs the request.
        stashed_hashes: a stale request's ``precomputed_block_hashes``, set aside (the request holds
            ``[]`` meanwhile so that ``add_request`` registers none) until it starts over or
            :func:`restore_all_hashes` puts them back.
        logits: ``(first generated-token index, epoch)`` boundaries: the weights that computed the
            logits each generated token was sampled from.
        kv: ``(first generated-token index, epoch)`` boundaries: the oldest weights that computed
            any KV in that token's prefix (the epoch its prefill began in).
        reverted_at: the request's progress (prefilled prompt tokens, generated tokens) when the
            patch was reverted while it was unfinished; None otherwise.
        ran_unseen: it made progress while the patch was reverted: the weights of what it computed
            meanwhile are unknown (a swap made then went unseen), so no version is reported.
    """

    prefill_epoch: Optional[int]
    context: Optional[weakref.ref] = None
    stashed_hashes: Optional[list[int]] = None
    logits: list[tuple[int, int]] = field(default_factory=list)
    kv: list[tuple[int, int]] = field(default_factory=list)
    reverted_at: Optional[tuple[int, int]] = None
    ran_unseen: bool = False


@dataclass(frozen=True)
class TokenWeightVersions:
    """The weight version behind each generated token of one request (see module docstring).

    Attributes:
        logits: per generated token, the version whose forward pass produced the logits it was
            sampled from.
        kv_prefix: per generated token, the oldest version that computed any KV the token attended
            to (prompt KV, matched prefix-cache blocks, earlier generated tokens).
    """

    logits: tuple[int, ...]
    kv_prefix: tuple[int, ...]

    @property
    def versions(self) -> tuple[int, ...]:
        """Every version any token of the request depends on, ascending."""
        return tuple(sorted({*self.logits, *self.kv_prefix}))

    @property
    def spans_versions(self) -> bool:
        """Whether the request's tokens depend on more than one version of the weights."""
        return len(self.versions) > 1


_BOOKS: RequestSideTable[RequestBooks] = RequestSideTable()


def books_of(request: Any) -> Optional[RequestBooks]:
    """The books of ``request``, or None if the patch never saw its prefill begin."""
    return _BOOKS.get(request)


def open_books(request: Any, context: Any, epoch: Optional[int]) -> RequestBooks:
    """Books for a request whose prefill begins now in ``context``, at ``epoch`` (first chunk, or a
    start over): tokens it generates from here on depend on KV of this epoch and on logits of this
    one until the next flush. ``epoch=None``: a request met mid-prefill, its weights unknown
    (nothing is marked; its tokens' versions are not recorded)."""
    books = _BOOKS.setdefault(request, lambda: RequestBooks(epoch))
    books.prefill_epoch, books.context = epoch, weakref.ref(context)
    if epoch is not None:
        generated = len(request.generated_tokens or ())
        _mark(books.kv, generated, epoch)
        _mark(books.logits, generated, epoch)
    return books


def note_flush(context: Any, epoch: int) -> None:
    """A flush moved ``context`` to ``epoch``: the next tokens of its unfinished requests are
    sampled from logits of that epoch."""
    for request, books in live_requests():
        if books.logits and books.context() is context and not _finished(request):
            _mark(books.logits, len(request.generated_tokens or ()), epoch)


def _finished(request: Any) -> bool:
    return getattr(request.status, "name", None) in ("COMPLETED", "FAILED")


def _mark(boundaries: list[tuple[int, int]], index: int, epoch: int) -> None:
    if boundaries and boundaries[-1][0] == index:
        boundaries[-1] = (index, epoch)  # nothing generated under the previous one
    elif not boundaries or boundaries[-1][1] != epoch:
        boundaries.append((index, epoch))


def live_requests() -> Iterator[tuple[Any, RequestBooks]]:
    """Every request object still alive that has books, with them."""
    return _BOOKS.items()


def restore_all_hashes() -> None:
    """Give every stale request its block hashes back (``revert()``: the released code expects a
    request to carry its own hashes)."""
    for request, books in live_requests():
        if books.stashed_hashes is not None:
            request.precomputed_block_hashes, books.stashed_hashes = books.stashed_hashes, None


def _progress(request: Any) -> tuple[int, int]:
    return request.finished_chunk_token_count, len(request.generated_tokens or ())


def note_revert() -> None:
    """The patch is reverted: remember how far each unfinished request got, so that what it
    computes until the next ``apply()`` (under weights nothing records) is known to be unseen."""
    for request, books in live_requests():
        if not _finished(request):
            books.reverted_at = _progress(request)


def note_reapply() -> None:
    """The patch is applied again: a request that made progress while it was reverted ran unseen."""
    for request, books in live_requests():
        if books.reverted_at is not None:
            books.ran_unseen |= _progress(request) != books.reverted_at
            books.reverted_at = None


def _expand(boundaries: list[tuple[int, int]], count: int) -> list[int]:
    versions = []
    for i, (start, epoch) in enumerate(boundaries):
        end = boundaries[i + 1][0] if i + 1 < len(boundaries) else count
        versions.extend([epoch] * (min(end, count) - min(start, count)))
    return versions


def token_weight_versions(request: Any) -> TokenWeightVersions:
    """The weight version behind each generated token of a request the engine ran.

    Args:
        request: a ``DynamicInferenceRequest`` the engine ran, or a ``DynamicInferenceRequestRecord``
            (0.18+: one request object per eviction; their tokens in order). Not a merged or
            deserialized copy: the books follow the object the engine ran, in its process.

    Returns:
        :class:`TokenWeightVersions`, one entry per generated token.

    Raises:
        WeightVersionsNotRecorded: the request (or one part of a record) was admitted while the
            ``weight-update-invalidation`` patch was not applied (always, on megatron-core carrying
            the source patches), is a copy, or made progress while the patch was reverted.
    """
    parts = list(getattr(request, "requests", None) or [request])
    logits: list[int] = []
    kv: list[int] = []
    for part in parts:
        books = books_of(part)
        count = len(part.generated_tokens or ())
        if count == 0:
            continue
        if books is None and hasattr(part, "prefix_cache_epoch"):  # the source patches' request field
            raise WeightVersionsNotRecorded(
                f"request {part.request_id}: no weight versions recorded: this megatron-core carries megatron-ext's "
                "source patches, where the weight-update-invalidation runtime patch (which records them) is not "
                "needed and never applied; they are recorded on released megatron-core with megatron_ext.apply()")
        if books is None or not books.kv or books.kv[0][0] > 0:
            raise WeightVersionsNotRecorded(
                f"request {part.request_id}: no weight versions recorded; they are recorded for the request "
                "objects the engine ran while the weight-update-invalidation patch was applied (megatron_ext.apply() "
                "before adding requests; pass the engine's record, not a merged or deserialized copy)")
        if books.ran_unseen or (books.reverted_at is not None and _progress(part) != books.reverted_at):
            raise WeightVersionsNotRecorded(
                f"request {part.request_id}: it ran while megatron-ext was reverted (between revert() and apply()), "
                "under weights no version was recorded for (a weight swap then goes unseen)")
        logits += _expand(books.logits, count)
        kv += _expand(books.kv, count)
    return TokenWeightVersions(tuple(logits), tuple(kv))
