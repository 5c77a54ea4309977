"""Reversible attribute replacement, shared by every piece of the CPU backend.

Each piece (device stand-ins, reference attention, Triton switch) replaces named attributes of
modules it does not own. :class:`AttributeSwap` records what was there, including "nothing", so
that restoring puts back the exact objects in reverse order and deletes what it added.
"""

from __future__ import annotations

from typing import Any

_MISSING = object()


class AttributeSwap:
    """Replace attributes on objects and put the originals back later.

    Not thread-safe; meant for process-level setup and teardown.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, Any]] = []

    def set(self, owner: object, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering the previous value (or its absence)."""
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)
                            if isinstance(owner, type) else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def restore(self) -> None:
        """Undo every :meth:`set`, newest first; attributes that did not exist are deleted."""
        while self._saved:
            owner, name, previous = self._saved.pop()
            if previous is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:  # already gone: nothing to undo
                    pass
            else:
                setattr(owner, name, previous)
