"""A guarded wrapper over a target that carries a transparent decorator (``functools.wraps``
around ``(*args, **kwargs)``: a profiler's or NVTX range's). Fingerprints see through
``__wrapped__``, so the patch applies; the guard then takes the instance as the first argument
given (the generic guard) instead of refusing the function and leaving ``apply()`` half done."""

from __future__ import annotations

import functools

from megatron_ext.guards import Guarded
from megatron_ext.patching import wrap_method


class Traced:
    flag = True

    def method(self, a, b=2):
        return a, b


_plain = Traced.__dict__["method"]


@functools.wraps(_plain)
def _traced(*args, **kwargs):
    return _plain(*args, **kwargs)


def test_a_guard_installs_over_a_transparent_decorator():
    seen = []

    def wrapper(wrapped, instance, args, kwargs):
        seen.append((args, kwargs))
        return wrapped(*args, **kwargs)

    patched = wrap_method(_traced, Guarded(wrapper, "flag"), "t")
    on, off = Traced(), Traced()
    off.flag = False
    assert patched(on, 1) == (1, 2) and patched(on, 1, b=3) == (1, 3)
    assert patched(off, 5, b=6) == (5, 6)
    assert seen == [((1,), {}), ((1,), {"b": 3})]
