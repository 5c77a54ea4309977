"""Other monkey patchers: foreign wrappers over (and under) megatron-ext's, before and after apply().

RL frameworks, tracers and profilers wrap megatron-core methods too. A foreign wrapper that calls
through leaves a patch applied: ``status()`` says so and names it, ``invalidate_prefix_cache``
works, ``revert()`` refuses (naming it) and changes nothing. One that replaces megatron-ext's
wrapper without calling through is named as such by ``status()``, the API and ``revert()``.
Before ``apply()``, a wrapper with a ``__wrapped__`` chain is seen through; one without it is
refused, naming it. Real contexts on the CPU: 8 KV blocks of 16 tokens, prompt A is two blocks.
"""

from __future__ import annotations

import functools
import re

import pytest
import wrapt

import megatron_ext
from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.errors import RevertBlockedError, WeightUpdatePatchNotApplied
from megatron_ext.harness.factories import small_prefix_caching_context
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.patches.matched_block_writes import ADD_REQUEST
from megatron_ext.patches.weight_update_invalidation import FIND_MATCH, REINITIALIZE, STEP
from megatron_ext.patches.weight_versions import books_of
from megatron_ext.patching import PatchState, installed_patches

from .conftest import SOURCE_PATCHED, UNPATCHED
from .context_factory import BLOCK, make_request

pytestmark = pytest.mark.skipif(UNPATCHED or SOURCE_PATCHED, reason="megatron-ext's own wrapping machinery")

A = list(range(1000, 1032))
HERE = __name__
CALLS: list[str] = []  # what the foreign wrappers saw, in order


def closure(inner):
    """A tracer's plain closure: calls through, no functools.wraps."""
    def traced(*args, **kwargs):
        CALLS.append(inner.__name__)
        return inner(*args, **kwargs)
    return traced


def with_wraps(inner):
    @functools.wraps(inner)
    def traced(*args, **kwargs):
        CALLS.append(inner.__name__)
        return inner(*args, **kwargs)
    return traced


def _wrapt_wrapper(wrapped, instance, args, kwargs):
    CALLS.append(wrapped.__name__)
    return wrapped(*args, **kwargs)


def with_wrapt(inner):
    return wrapt.FunctionWrapper(inner, _wrapt_wrapper)


_SAVED: dict[str, object] = {}


def via_global(inner):
    """Originals saved in a module-level registry and looked up there at each call (no __wrapped__;
    megatron-ext finds the original through the key's closure cell, not through the registry)."""
    _SAVED[inner.__name__] = inner

    def traced(self, *args, **kwargs):
        CALLS.append(inner.__name__)
        return _SAVED[inner.__name__](self, *args, **kwargs)
    return traced


WRAPPERS = {"closure": (closure, "closure.<locals>.traced"), "functools.wraps": (with_wraps, "with_wraps.<locals>.traced"),
            "wrapt": (with_wrapt, "_wrapt_wrapper (a wrapt.FunctionWrapper)"),
            "module global": (via_global, "via_global.<locals>.traced")}


def replacement(self, *args, **kwargs):  # pragma: no cover - never called
    """Foreign code that replaces a method without calling through."""


class Foreign:
    """Installs foreign wrappers on class attributes and removes them again (exactly)."""

    def __init__(self) -> None:
        self.saved: list[tuple[object, str, object]] = []

    def wrap(self, target, make) -> object:
        owner = target.owner()
        self.saved.append((owner, target.attribute, owner.__dict__[target.attribute]))
        setattr(owner, target.attribute, make(owner.__dict__[target.attribute]))
        return owner.__dict__[target.attribute]

    def remove(self) -> None:
        while self.saved:
            owner, name, previous = self.saved.pop()
            setattr(owner, name, previous)


@pytest.fixture
def foreign():
    CALLS.clear()
    installed = Foreign()
    yield installed
    installed.remove()
    megatron_ext.revert()


@pytest.fixture
def ctx():
    with cuda_on_cpu():
        yield small_prefix_caching_context("REF_ZERO", block_size_tokens=BLOCK, buffer_size_gb=9 * 2 * 2 * BLOCK * 4 * 16 * 4 / 2**30,
                                           max_requests=8, max_tokens=256, max_sequence_length=256)


def by_name(results) -> dict:
    return {r.patch: r for r in results}


def method_targets(results) -> list:
    """The distinct methods (not module globals: Triton kernels are launched, not called) that the
    applied patches wrap."""
    applied = {r.patch for r in results if r.state is PatchState.APPLIED}
    return list(dict.fromkeys(t for p in ALL_PATCHES if p.name in applied for t in p.wrappers() if "." in t.qualname))


@pytest.mark.parametrize("kind", WRAPPERS)
def test_status_names_foreign_wrappers_over_every_patched_method_and_revert_refuses(foreign, kind):
    make, qualname = WRAPPERS[kind]
    applied = {r.patch for r in megatron_ext.apply() if r.state is PatchState.APPLIED}
    targets = method_targets(megatron_ext.status())
    stacks = {t: installed_patches(t) for t in targets}
    wrapped = {t: foreign.wrap(t, make) for t in targets}
    status = by_name(megatron_ext.status())
    kernels_only = {p.name for p in ALL_PATCHES if p.name in applied and not set(p.wrappers()) & set(targets)}
    for name in applied:
        assert status[name].state is PatchState.APPLIED
        assert status[name].reason == ("already applied by megatron-ext" if name in kernels_only else
                                       f"already applied by megatron-ext (wrapped by foreign code: {HERE}:{qualname})")
    assert {t: installed_patches(t) for t in targets} == stacks
    with pytest.raises(RevertBlockedError, match=re.escape(f"is wrapped again by foreign code {HERE}:{qualname}; revert that first")):
        megatron_ext.revert()
    assert all(t.current() is wrapped[t] for t in targets)  # the refusal changed nothing
    assert by_name(megatron_ext.apply())["weight-update-invalidation"].state is PatchState.APPLIED
    assert all(t.current() is wrapped[t] for t in targets)  # apply() again adds no layer
    foreign.remove()  # the wrappers removed again: plain "applied", then a clean revert
    assert {by_name(megatron_ext.status())[name].reason for name in applied} == {"already applied by megatron-ext"}
    reverted = by_name(megatron_ext.revert())
    assert {name for name, r in reverted.items() if r.state is PatchState.REVERTED} == applied
    assert all(installed_patches(t) == [] for t in targets)
    assert {r.patch for r in megatron_ext.apply() if r.state is PatchState.APPLIED} == applied


@pytest.mark.parametrize("kind", WRAPPERS)
@pytest.mark.parametrize("target", [ADD_REQUEST, FIND_MATCH, STEP, REINITIALIZE], ids=lambda t: t.attribute)
def test_invalidate_prefix_cache_works_under_a_foreign_wrapper_of_any_fault_8_target(foreign, ctx, kind, target):
    megatron_ext.apply()
    foreign.wrap(target, WRAPPERS[kind][0])
    first = make_request(1, A)
    ctx.add_request(first)
    assert books_of(first) is not None  # fault 8's add_request wrapper ran (under the foreign one, if it is there)
    assert CALLS == {ADD_REQUEST: ["add_request"], FIND_MATCH: ["_find_kv_match_count"]}.get(target, [])
    result = megatron_ext.invalidate_prefix_cache(ctx)
    assert (result.blocks_unreachable, result.blocks_freed, result.epoch) == (2, 0, 1)
    ctx.add_request(make_request(2, A))  # the same prompt after the update matches nothing
    assert ctx.request_to_kv_block_ids[1][:2].tolist() != ctx.request_to_kv_block_ids[0][:2].tolist()
    assert ctx.kv_block_allocator.block_ref_counts.tolist().count(2) == 0


def test_a_replacement_that_does_not_call_through_is_named_everywhere(foreign, ctx):
    megatron_ext.apply()
    on_add_request = [p.name for p in ALL_PATCHES if p.is_applied() and ADD_REQUEST in p.wrappers()]
    assert "weight-update-invalidation" in on_add_request
    ours = ADD_REQUEST.current()
    foreign.wrap(ADD_REQUEST, lambda inner: replacement)
    now = f"DynamicInferenceContext.add_request is now {HERE}:replacement"
    status = by_name(megatron_ext.status())
    for name in on_add_request:
        assert status[name].state is PatchState.REFUSED
        assert status[name].reason == ("applied, but foreign code replaced megatron-ext's wrapper without calling "
                                       f"through to it, so the fix does not run ({now}); make that code call the "
                                       "function it replaced, or remove it")
    with pytest.raises(WeightUpdatePatchNotApplied, match=f"invalidate_prefix_cache: the weight-update-invalidation "
                       f"patch was applied, but foreign code replaced its wrapper without calling through to it, so "
                       fr"megatron-ext no longer sees weight updates there \({now}\)"):
        megatron_ext.invalidate_prefix_cache(ctx)
    assert by_name(megatron_ext.apply())["weight-update-invalidation"].state is PatchState.REFUSED
    assert ADD_REQUEST.current() is replacement  # apply() put nothing over it
    with pytest.raises(RevertBlockedError, match=f"add_request was replaced by foreign code {HERE}:replacement "
                       "without calling through"):
        megatron_ext.revert()
    assert "weight-update-invalidation" in installed_patches(FIND_MATCH)  # nothing was reverted
    foreign.remove()
    assert ADD_REQUEST.current() is ours
    assert by_name(megatron_ext.status())["weight-update-invalidation"].reason == "already applied by megatron-ext"
    assert by_name(megatron_ext.revert())["weight-update-invalidation"].state is PatchState.REVERTED


@pytest.mark.parametrize("kind", ["closure", "module global"])
def test_a_wrapper_that_hides_the_code_before_apply_is_refused_naming_it(foreign, kind):
    make, qualname = WRAPPERS[kind]
    hidden = foreign.wrap(ADD_REQUEST, make)
    results = by_name(megatron_ext.apply())
    checking = [p.name for p in ALL_PATCHES if ADD_REQUEST in p.checked_functions()]
    assert "weight-update-invalidation" in checking
    for name in checking:
        if results[name].state is PatchState.NOT_NEEDED:  # decided by a probe, before any code check
            continue
        assert results[name].state is PatchState.REFUSED, name
        assert f"DynamicInferenceContext.add_request in megatron-core {megatron_ext.mcore.installed_version()} is " \
               f"wrapped by foreign code {HERE}:{qualname}, which hides the code it wraps: give that wrapper " \
               "functools.wraps (a __wrapped__ chain; wrapt's wrappers have one)" in results[name].reason
    assert ADD_REQUEST.current() is hidden and installed_patches(ADD_REQUEST) == []


@pytest.mark.parametrize("kind", ["functools.wraps", "wrapt"])
def test_a_wrapper_with_a_wrapped_chain_before_apply_is_seen_through(foreign, ctx, kind):
    before = foreign.wrap(ADD_REQUEST, WRAPPERS[kind][0])
    results = by_name(megatron_ext.apply())
    assert results["weight-update-invalidation"].state is PatchState.APPLIED
    stack = installed_patches(ADD_REQUEST)
    assert "weight-update-invalidation" in stack
    innermost = ADD_REQUEST.current()
    for _ in stack[1:]:
        innermost = innermost.__wrapped__
    assert innermost.__wrapped__ is before  # megatron-ext's wrappers call the foreign one
    first = make_request(1, A)
    ctx.add_request(first)
    assert CALLS == ["add_request"] and books_of(first) is not None
    assert megatron_ext.invalidate_prefix_cache(ctx).blocks_unreachable == 2
    megatron_ext.revert()
    assert ADD_REQUEST.current() is before  # exactly what was there


_original_add_request = None  # a tracer's saved original, a module global (no closure, no __wrapped__)


def traced_add_request(self, *args, **kwargs):
    CALLS.append("add_request")
    return _original_add_request(self, *args, **kwargs)


def test_an_original_saved_in_a_module_global_is_followed(foreign, ctx):
    global _original_add_request
    megatron_ext.apply()
    foreign.wrap(ADD_REQUEST, lambda inner: traced_add_request)
    _original_add_request = foreign.saved[-1][2]  # what the tracer replaced: megatron-ext's wrapper
    try:
        assert by_name(megatron_ext.status())["weight-update-invalidation"].reason == (
            f"already applied by megatron-ext (wrapped by foreign code: {HERE}:traced_add_request)")
        first = make_request(1, A)
        ctx.add_request(first)
        assert CALLS == ["add_request"] and books_of(first) is not None
        assert megatron_ext.invalidate_prefix_cache(ctx).blocks_unreachable == 2
    finally:
        _original_add_request = None
