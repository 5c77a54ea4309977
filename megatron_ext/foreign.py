"""Foreign wrappers: what other monkey patchers put over (or under) a patched megatron-core function.

RL frameworks, tracers and profilers wrap megatron-core methods too, not always with
``functools.wraps``. :mod:`megatron_ext.patching` records the functions it installs by identity;
this module answers the two questions that record leaves: is one of them still reachable from
the object a class now holds (:func:`path_to`), and what is that object, in words
(:func:`describe`)?

Reachable means referenced the way a wrapper that calls through holds what it wraps: its
``__wrapped__`` (``functools.wraps``, ``wrapt``), a bound method's ``__func__``, a
``functools.partial``'s function and arguments, a closure cell, a default argument, a module
global its code names, or an attribute of a callable object. It is a reference, not a proof of a
call: a wrapper that keeps the function it replaced without calling it still counts as reaching it.
"""

from __future__ import annotations

import functools
import types
from collections import deque
from typing import Any, Callable, Iterator, Optional

#: How far :func:`path_to` looks below a foreign object (a wrapper of a wrapper of ...), and how
#: many objects it visits at most: enough for stacked decorators, cheap on the status path.
MAX_DEPTH = 6
MAX_VISITED = 500


def describe(obj: Any) -> str:
    """``module:qualname`` of a wrapper, from its code rather than its (maybe copied) metadata:
    ``functools.wraps`` copies ``__module__`` and ``__qualname__`` of what it wraps, so those
    would name the wrapped function. A ``wrapt`` wrapper is named by its wrapper function."""
    if _is_wrapt(obj):
        return f"{describe(obj._self_wrapper)} (a wrapt.{type(obj).__name__})"
    if type(obj) is types.MethodType:
        return describe(obj.__func__)
    if type(obj) is functools.partial:
        return f"functools.partial of {describe(obj.func)}"
    if type(obj) is types.FunctionType:
        return f"{obj.__globals__.get('__name__', '?')}:{obj.__code__.co_qualname}"
    kind = type(obj)
    return f"{kind.__module__}:{kind.__qualname__} instance"


def _is_wrapt(obj: Any) -> bool:
    """A ``wrapt`` function wrapper. Not by ``isinstance``: a ``wrapt`` proxy reports the wrapped
    object's ``__class__``."""
    return type(obj).__module__.split(".")[0] in ("wrapt", "_wrappers") and hasattr(obj, "_self_wrapper")


def defined_in_megatron(obj: Any) -> bool:
    """Whether ``obj`` is megatron-core's own code (a function of a ``megatron.*`` module, e.g. one
    of its decorators), as opposed to a foreign wrapper."""
    return describe(obj).startswith("megatron.")


def path_to(start: Any, goal: Callable[[Any], bool], opaque: Callable[[Any], bool]) -> Optional[list[Any]]:
    """The shortest chain of references from ``start`` to an object for which ``goal`` holds,
    ``[start, ..., found]``; ``[start]`` if ``start`` itself is one; None if none is reachable
    within :data:`MAX_DEPTH` references (:data:`MAX_VISITED` objects). The references of an
    object for which ``opaque`` holds are not followed (megatron-core's own code calls
    megatron-core, not a wrapper above it)."""
    queue: deque[tuple[Any, list[Any]]] = deque([(start, [start])])
    seen = {id(start)}
    while queue and len(seen) <= MAX_VISITED:
        obj, path = queue.popleft()
        if goal(obj):
            return path
        if len(path) > MAX_DEPTH or opaque(obj):
            continue
        for ref in _references(obj):
            if id(ref) not in seen:
                seen.add(id(ref))
                queue.append((ref, [*path, ref]))
    return None


def _references(obj: Any) -> Iterator[Any]:
    """What ``obj`` may call through to (see the module docstring). Modules and classes are not
    followed: everything is reachable from a module."""
    try:
        wrapped = getattr(obj, "__wrapped__", None)
    except Exception:  # noqa: BLE001 - an uninitialized wrapt proxy raises ValueError
        wrapped = None
    if wrapped is not None:
        yield wrapped
    if _is_wrapt(obj):
        return  # its __wrapped__ is what it calls (its wrapper gets it as an argument)
    if type(obj) is types.MethodType:
        yield obj.__func__
    elif type(obj) is functools.partial:
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
    elif type(obj) is types.FunctionType:
        yield from _function_references(obj)
    elif not isinstance(obj, (type, types.ModuleType)) and callable(obj):
        yield from (value for value in getattr(obj, "__dict__", {}).values() if callable(value))


def _function_references(function: types.FunctionType) -> Iterator[Any]:
    for cell in function.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    yield from function.__defaults__ or ()
    yield from (function.__kwdefaults__ or {}).values()
    names = _global_names(function.__code__)
    for name in names:
        value = function.__globals__.get(name)
        if value is not None and not isinstance(value, (type, types.ModuleType)) and callable(value):
            yield value


def _global_names(code: types.CodeType) -> set[str]:
    """The names a code object and the code objects nested in it (lambdas, inner functions) look
    up; some of them are globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names
