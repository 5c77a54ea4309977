"""``apply()``, ``revert()`` and ``status()``: the public entry points of the runtime patches."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from . import mcore
from .env import flag, name_set
from .errors import MegatronExtError, PatchRefusedError, RevertBlockedError, WeightUpdatePatchNotApplied
from .patching import PatchResult, PatchState
from .patches import ALL_PATCHES

if TYPE_CHECKING:
    from .patches.weight_update_invalidation import InvalidationResult
    from .patches.weight_versions import TokenWeightVersions

# One lock for every apply/revert, so concurrent callers never see half-applied patch sets.
_LOCK = threading.RLock()
# Installed patches in installation order: revert unwinds them last-first, because several patches
# may wrap one target (each wrapper wraps the previous one).
_INSTALLED: list = []

FORCE_ENV = "MEGATRON_EXT_FORCE"
SKIP_ENV = "MEGATRON_EXT_SKIP"


def _env_force() -> bool:
    return flag(FORCE_ENV)


def _skipped() -> set[str]:
    """The patch names in ``MEGATRON_EXT_SKIP``.

    Raises:
        MegatronExtError: a name is not a patch (a typo would leave that patch applied, silently).
    """
    names = name_set(SKIP_ENV)
    unknown = sorted(names - {patch.name for patch in ALL_PATCHES})
    if unknown:
        raise MegatronExtError(f"{SKIP_ENV} names {', '.join(unknown)}, which is not a patch; patches: "
                               f"{', '.join(patch.name for patch in ALL_PATCHES)}")
    return names


def status(force: bool | None = None) -> list[PatchResult]:
    """Report, without changing anything, what :func:`apply` would do with each patch.

    Args:
        force: as for :func:`apply`; ``None`` reads ``MEGATRON_EXT_FORCE``.

    Returns:
        One :class:`PatchResult` per patch with state APPLIED, APPLICABLE, NOT_NEEDED or REFUSED,
        or NOT_APPLIED for the patches named in ``MEGATRON_EXT_SKIP`` and those whose
        :attr:`~megatron_ext.patching.Patch.requires` are not met.

    Raises:
        MegatronCoreNotFoundError: megatron-core is not importable.
        UnsupportedReleaseError: megatron-core is older than 0.17.0 (unless forced).
        MegatronExtError: ``MEGATRON_EXT_SKIP`` names something that is not a patch.
    """
    force = _env_force() if force is None else force
    version = _version(force)
    skipped = _skipped()
    with _LOCK:
        return _plans(version, force, skipped, strict=False)


def apply(force: bool | None = None, strict: bool = False) -> list[PatchResult]:
    """Apply every patch the installed megatron-core needs. Idempotent and thread-safe.

    Args:
        force: apply even to an unsupported release or a changed target (after you checked the
            code yourself). ``None`` reads ``MEGATRON_EXT_FORCE``. It does not lift a patch's
            :attr:`~megatron_ext.patching.Patch.requires`.
        strict: raise instead of reporting a refusal.

    Returns:
        One :class:`PatchResult` per patch: APPLIED (now or before), NOT_NEEDED, or REFUSED.
        Patches named in ``MEGATRON_EXT_SKIP`` (comma-separated) are reported NOT_APPLIED, and so
        is a patch that requires one of them or one refused (REFUSED under ``strict``).

    Raises:
        MegatronCoreNotFoundError: megatron-core is not importable.
        UnsupportedReleaseError: megatron-core is older than 0.17.0 (unless forced); nothing is
            applied. Any newer tree is judged patch by patch by its code (:meth:`Patch.plan`).
        PatchRefusedError: with ``strict=True``, if any patch was refused; nothing is applied then.
            A patch named in ``MEGATRON_EXT_SKIP`` is never refused (it is not considered at all).
        MegatronExtError: ``MEGATRON_EXT_SKIP`` names something that is not a patch; nothing is applied.
    """
    force = _env_force() if force is None else force
    version = _version(force)
    skipped = _skipped()
    with _LOCK:
        plans = _plans(version, force, skipped, strict)
        refused = [plan for plan in plans if plan.state is PatchState.REFUSED]
        if strict and refused:
            raise PatchRefusedError("; ".join(f"{r.patch}: {r.reason}" for r in refused))
        results = []
        for patch, plan in zip(ALL_PATCHES, plans):
            if plan.state is PatchState.APPLICABLE:
                patch.install()
                _INSTALLED.append(patch)
                result = patch.result(PatchState.APPLIED, plan.reason, plan.evidence)
            else:
                result = plan
            patch.settled(result)
            results.append(result)
        return results


def _version(force: bool) -> str:
    """The installed release, refused if older than 0.17.0 unless ``force`` (:func:`mcore.require_supported`)."""
    version = mcore.installed_version()
    if not force:
        mcore.require_supported(version, f", or force with {FORCE_ENV}=1 / apply(force=True) after checking "
                                "the target code yourself")
    return version


#: States of a required patch that let the patches requiring it apply: its fix is (or is about to
#: be) installed, or the installed code has it.
_MET = (PatchState.APPLIED, PatchState.APPLICABLE, PatchState.NOT_NEEDED)


def _plans(version: str, force: bool, skipped: set[str], strict: bool) -> list[PatchResult]:
    """What :func:`apply` does with each patch of ``ALL_PATCHES``, in its order.

    A skipped patch is not planned at all: the job left it out, so its refusal (or a probe that
    fails on this machine) must neither raise under strict=True nor be reported. A patch that would
    be applied without a patch it requires (:attr:`Patch.requires`, in any order of
    ``ALL_PATCHES``) is not: NOT_APPLIED, or REFUSED under ``strict`` when that patch is skipped or
    refused (a choice of the job, or a release, that leaves the fix wrong).
    """
    plans = {patch.name: patch.result(PatchState.NOT_APPLIED, f"skipped by {SKIP_ENV}") if patch.name in skipped
             else patch.plan(version, force) for patch in ALL_PATCHES}
    requires = {patch.name: patch.requires for patch in ALL_PATCHES}
    done: set[str] = set()

    def resolve(name: str) -> PatchResult:
        plan = plans[name]
        if name in done or plan.state is not PatchState.APPLICABLE:
            return plan
        done.add(name)
        for required in requires[name]:
            state = resolve(required).state
            if state in _MET:
                continue
            if required in skipped:
                why = f"which {SKIP_ENV} leaves out; leave out both or neither"
            else:
                why = f"which is {state.value}"
            refused = strict and (required in skipped or state is PatchState.REFUSED)
            plans[name] = dataclasses.replace(plan, state=PatchState.REFUSED if refused else PatchState.NOT_APPLIED,
                                              reason=f"needs {required}, {why}")
            break
        return plans[name]

    return [resolve(patch.name) for patch in ALL_PATCHES]


def installed_tree() -> tuple[str, ...]:
    """The known trees (:func:`megatron_ext.fingerprints.known_trees`) whose code every patch's
    checked functions are, oldest first: ``("0.19.0", "0.19.2")`` on 0.19.2 (its inference code
    equals 0.19.0's), ``("2a75ac12c5",)`` on NeMo-RL's Megatron-LM; ``()`` on code no known tree has
    in full (each patch is then decided on its own, :meth:`~megatron_ext.patching.Patch.plan`).

    Raises:
        MegatronCoreNotFoundError: megatron-core is not importable.
    """
    from .fingerprints import known_trees

    mcore.installed_version()  # names a missing megatron-core in one line
    trees = set(known_trees())
    with _LOCK:
        for patch in ALL_PATCHES:
            match = patch.match()
            trees &= {*match.faulty, *match.fixed}
    return tuple(name for name in known_trees() if name in trees)


def revert() -> list[PatchResult]:
    """Restore the original megatron-core functions exactly. Thread-safe; a no-op if nothing is applied.

    Returns:
        One :class:`PatchResult` per patch: REVERTED or NOT_APPLIED.

    Raises:
        RevertBlockedError: foreign code wrapped (or replaced) a patched function after
            :func:`apply`; the message names it. Nothing is reverted: revert that code first.
    """
    with _LOCK:
        blockers = [blocker for patch in _INSTALLED if (blocker := patch.revert_blocker(outer_patches_first=True))]
        if blockers:
            raise RevertBlockedError("; ".join(blockers))
        reverted = set()
        while _INSTALLED:
            patch = _INSTALLED.pop()
            if patch.uninstall():
                reverted.add(patch.name)
        results = [
            patch.result(PatchState.REVERTED, "original functions restored") if patch.name in reverted
            else patch.result(PatchState.NOT_APPLIED, "was not applied")
            for patch in ALL_PATCHES
        ]
        for patch, result in zip(ALL_PATCHES, results):
            patch.settled(result)
        return results


def invalidate_prefix_cache(target: Any) -> "InvalidationResult":
    """Flush the prefix cache of an engine or context after its model's weights changed (fault 8).

    For loops that update weights without ``engine.suspend()`` / ``resume()`` or
    ``swap_model_weights`` (which the patch recognises by itself), e.g. an optimizer step on the
    model the engine serves. Call it on every rank of a model-parallel group at the same point
    (between the same two engine steps), with the engine not stepping. Idempotent: a second call
    finds nothing registered. Requests admitted afterwards match only blocks cached afterwards;
    live requests keep their blocks (see :mod:`megatron_ext.patches.weight_update_invalidation`).

    On a megatron-core tree carrying the source patches (``megatron-ext patch-source``) the
    runtime patch is "not needed" and not applied: the context's own source-patched
    ``invalidate_prefix_cache()`` does the same flush and its counts are returned.

    With the ``mamba-decode-a-cache`` patch applied (fault H11), a call that returns also refills
    every Mamba layer's decode cache of ``-exp(A_log)`` from the current weights.

    Args:
        target: a ``DynamicInferenceEngine`` or a ``DynamicInferenceContext``.

    Returns:
        :class:`~megatron_ext.patches.weight_update_invalidation.InvalidationResult`: the counts and
        the new weight version; ``kept=True`` and nothing done (a warning, once, through the
        ``megatron_ext`` logger) when the last :func:`apply` ran under
        ``MEGATRON_EXT_ON_WEIGHT_UPDATE=keep``. A flush that leaves anything matchable warns too.

    Raises:
        TypeError: ``target`` is neither an engine nor a context.
        WeightUpdatePatchNotApplied: the ``weight-update-invalidation`` patch is not applied
            (call :func:`apply` first), or foreign code replaced one of its wrappers without
            calling through to it (the message names that code), and the installed code is not
            source-patched; without either, a chunked prefill straddling the update would
            register blocks computed from the old weights' KV. Foreign wrappers that call
            through (with ``functools.wraps`` or not) leave the patch applied.
    """
    from .patches import weight_update_invalidation as fault8

    context = getattr(target, "context", target)
    if not hasattr(context, "kv_block_allocator"):
        raise TypeError(f"invalidate_prefix_cache takes a DynamicInferenceEngine or DynamicInferenceContext, "
                        f"not {type(target).__name__}")
    patch = _weight_update_patch()
    with _LOCK:
        if patch.is_applied():
            return _refresh_mamba_decode_a(fault8.flush(context))
        if patch.mode == "keep":
            fault8.warn_once("keep", f"invalidate_prefix_cache did nothing: {fault8.ON_WEIGHT_UPDATE_ENV}=keep at "
                             "megatron_ext.apply(), so prefix-cached KV of the old weights stays matchable")
            return _refresh_mamba_decode_a(fault8.InvalidationResult(kept=True))
        try:
            source_patched = not patch.needed()[0]
        except Exception:  # an unreadable source is no evidence of the fix (as in plan())
            source_patched = False
        bypassed = _bypassed(patch)
    if source_patched:
        unreachable, freed = context.invalidate_prefix_cache()
        return _refresh_mamba_decode_a(
            fault8.checked(context, fault8.InvalidationResult(unreachable, freed, epoch=context.prefix_cache_epoch)))
    if bypassed:
        raise WeightUpdatePatchNotApplied(f"invalidate_prefix_cache: {bypassed}")
    raise WeightUpdatePatchNotApplied(
        "invalidate_prefix_cache needs the weight-update-invalidation patch: call megatron_ext.apply() "
        "first (megatron_ext.status() says why it is not applied)")


def token_weight_versions(request: Any) -> "TokenWeightVersions":
    """The weight version behind each generated token of a request the engine ran (fault 8's books).

    A weight version is the engine context's prefix-cache epoch: 0 for the weights it started with,
    +1 at each weight update the patch saw (``resume()`` after ``suspend()``,
    ``swap_model_weights``, :func:`invalidate_prefix_cache`). A request in flight across an update
    shows two: its later tokens' logits come from the new weights while their KV prefix holds the
    old weights' KV.

    Args:
        request: the ``DynamicInferenceRequest`` (or, 0.18+, the ``DynamicInferenceRequestRecord``)
            the engine ran, in the process that ran it.

    Returns:
        :class:`~megatron_ext.patches.weight_versions.TokenWeightVersions`: per generated token,
        ``logits`` and ``kv_prefix`` (oldest) versions.

    Raises:
        WeightVersionsNotRecorded: admitted while the ``weight-update-invalidation`` patch was not
            applied (or under ``MEGATRON_EXT_ON_WEIGHT_UPDATE=keep``), a merged / deserialized copy,
            or it ran while the patch was reverted (a swap then goes unseen).
    """
    from .patches.weight_versions import WeightVersionsNotRecorded, token_weight_versions as versions

    try:
        return versions(request)
    except WeightVersionsNotRecorded as exc:
        with _LOCK:
            bypassed = _bypassed(_weight_update_patch())
        if bypassed:
            raise WeightVersionsNotRecorded(f"{exc}; {bypassed}") from None
        raise


def _refresh_mamba_decode_a(result: "InvalidationResult") -> "InvalidationResult":
    """``result``, after refilling the Mamba decode caches of ``-exp(A_log)`` (fault H11): the same
    update may have changed ``A_log``. By the ``mamba-decode-a-cache`` patch when it is applied, by
    the source-patched mixer module's ``refresh_decode_A_caches`` on a tree with ``patches/``."""
    import sys

    from .patches import mamba_decode_a_cache as h11

    if next(p for p in ALL_PATCHES if p.name == h11.MambaDecodeACachePatch.name).is_applied():
        h11.refresh_all()
    else:
        source_patched = getattr(sys.modules.get(h11.MAMBA_MIXER_MODULE), "refresh_decode_A_caches", None)
        if source_patched is not None:
            source_patched()
    return result


def _weight_update_patch() -> Any:
    """The ``weight-update-invalidation`` patch (fault 8) of :data:`ALL_PATCHES`."""
    return next(p for p in ALL_PATCHES if p.name == "weight-update-invalidation")


def _bypassed(patch: Any) -> str:
    """A sentence naming the foreign code that bypasses an installed patch's wrappers, or ``""``."""
    where = patch.bypass_summary()
    if not where:
        return ""
    return (f"the {patch.name} patch was applied, but foreign code replaced its wrapper without calling through "
            f"to it, so megatron-ext no longer sees weight updates there ({where}); make that code call the "
            "function it replaced, or remove it")
