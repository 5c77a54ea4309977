"""``Guarded`` wrappers (megatron_ext.guards): a patch with nothing to do on an instance costs
no Python layer of its own there, and two patches with the same test share one test per call."""

from __future__ import annotations

import pytest

from megatron_ext.guards import BYPASS_ATTR, Guarded
from megatron_ext.patching import PATCH_MARKER, wrap_method


class Context:
    def __init__(self, hybrid: bool) -> None:
        self.is_hybrid_model = hybrid

    def match(self, tokens: int, chunk: int = 16) -> tuple[int, int]:
        return tokens, chunk


def _recording(name: str, seen: list[str]):
    def wrapper(wrapped, instance, args, kwargs):
        seen.append(name)
        skip, chunk = wrapped(*args, **kwargs)
        return skip + 1, chunk
    return wrapper


def test_a_guarded_wrapper_runs_only_where_its_test_holds():
    seen: list[str] = []
    original = Context.__dict__["match"]
    patched = wrap_method(original, Guarded(_recording("h1", seen), "is_hybrid_model"), "h1")
    assert patched(Context(True), 32, chunk=48) == (33, 48)
    assert patched(Context(False), 32, chunk=48) == (32, 48)
    assert seen == ["h1"]
    assert getattr(patched, PATCH_MARKER) == "h1" and patched.__wrapped__ is original
    assert getattr(patched, BYPASS_ATTR) == (("is_hybrid_model", True), original)


def test_two_guarded_wrappers_with_one_test_bypass_to_the_original_together():
    seen: list[str] = []
    original = Context.__dict__["match"]
    inner = wrap_method(original, Guarded(_recording("inner", seen), "is_hybrid_model"), "inner")
    outer = wrap_method(inner, Guarded(_recording("outer", seen), "is_hybrid_model"), "outer")
    assert getattr(outer, BYPASS_ATTR)[1] is original  # not `inner`: one test per call
    assert outer(Context(True), 32) == (34, 16)
    assert seen == ["outer", "inner"]
    assert outer(Context(False), 32) == (32, 16)
    assert seen == ["outer", "inner"]


def test_a_guarded_wrapper_over_another_test_or_a_plain_wrapper_calls_what_it_wraps():
    seen: list[str] = []
    original = Context.__dict__["match"]
    plain = wrap_method(original, _recording("plain", seen), "plain")
    assert getattr(plain, BYPASS_ATTR) is None
    other = wrap_method(plain, Guarded(_recording("other", seen), "is_hybrid_model", False), "other")
    assert getattr(other, BYPASS_ATTR)[1] is plain
    outer = wrap_method(other, Guarded(_recording("outer", seen), "is_hybrid_model"), "outer")
    assert getattr(outer, BYPASS_ATTR)[1] is other
    assert outer(Context(False), 32) == (34, 16)  # other (its test holds) and plain ran
    assert seen == ["other", "plain"]
    assert outer(Context(True), 32) == (34, 16)  # outer and plain ran; other stood aside
    assert seen == ["other", "plain", "outer", "plain"]


def test_a_guarded_wrapper_needs_a_plain_function():
    with pytest.raises(TypeError, match="needs a plain function to wrap, not staticmethod"):
        wrap_method(staticmethod(lambda: 0), Guarded(_recording("x", []), "is_hybrid_model"), "x")


def test_the_redirect_writes_through_a_view_that_follows_the_context_tensor():
    """``matched-block-writes`` fills CPU ``token_to_block_idx`` through a NumPy view kept per
    context; a context given a new tensor gets a new view (never a write into the old one)."""
    import types

    import torch

    from megatron_ext.patches.matched_block_writes import redirect_matched_block_writes

    first = torch.arange(8, dtype=torch.int32)
    context = types.SimpleNamespace(token_to_block_idx=first,
                                    kv_block_allocator=types.SimpleNamespace(dummy_block_idx=99))
    # tokens at positions 16..21 added from slot 2 (offset -14); a matched block covers 16..19
    redirect_matched_block_writes(context, -14, 16, 22, [(0, 16), (16, 20)])
    assert first.tolist() == [0, 1, 99, 99, 99, 99, 6, 7]
    second = torch.zeros(8, dtype=torch.int32)
    context.token_to_block_idx = second
    redirect_matched_block_writes(context, 0, 0, 8, [(6, 8), (9, 12)])
    assert second.tolist() == [0, 0, 0, 0, 0, 0, 99, 99]
    assert first.tolist() == [0, 1, 99, 99, 99, 99, 6, 7]


class Signatures:
    flag = True

    def method(self, a, /, b, c=3, *rest, d, e=5, **extra):
        return a, b, c, rest, d, e, extra


def test_a_guarded_function_keeps_the_signature_and_passes_every_argument_on():
    """The installed function is generated with the original's parameter list: the bypass passes
    arguments on unchanged; the wrapper gets them positionally with defaults filled in (keyword-only
    ones and ``**extra`` in ``kwargs``)."""
    import inspect

    seen: list[tuple] = []

    def wrapper(wrapped, instance, args, kwargs):
        seen.append((args, kwargs))
        return wrapped(*args, **kwargs)

    original = Signatures.__dict__["method"]
    patched = wrap_method(original, Guarded(wrapper, "flag"), "sig")
    assert str(inspect.signature(patched, follow_wrapped=False)) == "(self, a, /, b, c=3, *rest, d, e=5, **extra)"
    on, off = Signatures(), Signatures()
    off.flag = False
    assert patched(on, 1, 2, 9, 10, d=4, z=1) == (1, 2, 9, (10,), 4, 5, {"z": 1})
    assert seen == [((1, 2, 9, 10), {"d": 4, "e": 5, "z": 1})]
    assert patched(off, 1, b=2, d=4) == (1, 2, 3, (), 4, 5, {})
    assert len(seen) == 1
    with pytest.raises(TypeError, match="missing 1 required positional argument: .a."):  # a is positional-only
        patched(on, a=1, b=2, d=4)


def test_a_guard_refuses_what_its_generated_code_cannot_read():
    def uses_reserved(self, _megatron_ext_value):
        return _megatron_ext_value

    with pytest.raises(ValueError, match="parameter '_megatron_ext_value' of .* starts with '_megatron_ext_'"):
        wrap_method(uses_reserved, Guarded(_recording("x", []), "flag"), "x")
    with pytest.raises(ValueError, match="a guard reads an attribute by name, not 'a.b'"):
        wrap_method(Signatures.__dict__["method"], Guarded(_recording("x", []), "a.b"), "x")
    # no named instance parameter (a transparent decorator's (*args, **kwargs)): the generic guard
    generic = wrap_method(lambda *args: args, Guarded(_recording("x", []), "flag"), "x")
    off = Signatures()
    off.flag = False
    assert generic(off, 1) == (off, 1)
