"""State the runtime patches keep per request object, beside it rather than in it.

megatron-core serializes a request by copying its ``__dict__`` (``InferenceRequest.serialize``)
and rebuilds it with ``cls(**obj)``: an attribute a patch set there makes ``deserialize`` raise
``TypeError: unexpected keyword argument``. A :class:`RequestSideTable` keys its entries by the
request object through a weak reference, so an entry goes when its request is freed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

T = TypeVar("T")


class RequestSideTable(Generic[T]):
    """Request object -> value, by identity (a request dataclass is unhashable: ``eq=True``)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, T]] = {}

    def get(self, request: Any) -> Optional[T]:
        """The value kept for ``request``, or None."""
        entry = self._entries.get(id(request))
        return entry[1] if entry is not None else None

    def set(self, request: Any, value: T) -> T:
        """Keep ``value`` for ``request`` until it is freed (or :meth:`pop`); returns ``value``."""
        key = id(request)
        entries = self._entries
        entries[key] = (weakref.ref(request, lambda _ref: entries.pop(key, None)), value)
        return value

    def setdefault(self, request: Any, factory: Callable[[], T]) -> T:
        """The value kept for ``request``, made by ``factory()`` and kept if there is none."""
        entry = self._entries.get(id(request))
        return entry[1] if entry is not None else self.set(request, factory())

    def pop(self, request: Any) -> Optional[T]:
        """Forget ``request``; its value, or None."""
        entry = self._entries.pop(id(request), None)
        return entry[1] if entry is not None else None

    def items(self) -> Iterator[tuple[Any, T]]:
        """Every (request, value) whose request is still alive."""
        for ref, value in list(self._entries.values()):
            request = ref()
            if request is not None:
                yield request, value
