"""The mechanism shared by every runtime patch: declared releases, target fingerprints, wrapping.

A :class:`Patch` names the megatron-core functions it wraps (:class:`Target`), the releases it was
written against, and a fingerprint of each target's source per release (recorded in
``fingerprints.json`` by ``scripts/record_fingerprints.py``). Before wrapping anything it
checks that the installed release is supported and that each target's source is the code it was
written against; otherwise it refuses, unless the caller forces it. A patch replaces the class
attribute with a plain function that calls its wrapper (:func:`wrap_method`), so instances created
before :func:`megatron_ext.apply` are covered too, and :meth:`Patch.revert` puts back the exact
object that was there before. Wrappers keep ``wrapt``'s calling convention
``wrapper(wrapped, instance, args, kwargs)``; a plain function costs less than half of a
``wrapt.FunctionWrapper`` per call, and the admission path (``add_request``) runs several.
Fingerprints are :mod:`megatron_ext.fingerprints`' concern, guarded wrappers (no Python layer on
the instances a fix leaves alone) :mod:`megatron_ext.guards`'.
"""

from __future__ import annotations

import enum
import functools
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from . import mcore
from .fingerprints import RecordedFingerprints, fingerprint
from .guards import BYPASS_ATTR, Guarded, guarded_function

#: Attribute set on every wrapper megatron-ext installs, naming the patch that installed it.
PATCH_MARKER = "_self_megatron_ext_patch"


@dataclass(frozen=True)
class KernelLaunch:
    """A wrapper of a Triton kernel's launches, for a target that is the kernel itself (a module
    global its launcher looks up at call time and launches as ``kernel[grid](*args, **kwargs)``).

    :func:`wrap_kernel` stores a :class:`WrappedKernel` in its place: each launch calls
    ``wrapper(kernel[grid], None, args, kwargs)`` (``wrapt``'s convention, no instance) instead.

    Attributes:
        wrapper: ``wrapper(launch, None, args, kwargs)``, which calls ``launch`` itself.
    """

    wrapper: Callable


class WrappedKernel:
    """What :func:`wrap_kernel` stores in place of a Triton kernel: ``self[grid](*args, **kwargs)``
    calls the :class:`KernelLaunch` wrapper with ``kernel[grid]``; every other attribute is the
    kernel's own. ``__wrapped__`` is the kernel, :data:`PATCH_MARKER` the patch's name."""

    def __init__(self, kernel: Any, wrapper: Callable, patch_name: str) -> None:
        self.__wrapped__ = kernel
        self.launch_wrapper = wrapper
        setattr(self, PATCH_MARKER, patch_name)

    def __getitem__(self, grid: Any) -> Callable:
        launch, wrapper = self.__wrapped__[grid], self.launch_wrapper
        return lambda *args, **kwargs: wrapper(launch, None, args, kwargs)

    def __getattr__(self, name: str) -> Any:  # only names the instance does not have itself
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)


def wrap_kernel(kernel: Any, launch: KernelLaunch, patch_name: str) -> WrappedKernel:
    """A :class:`WrappedKernel` to store in place of the Triton kernel ``kernel`` (a module global)."""
    return WrappedKernel(kernel, launch.wrapper, patch_name)


def wrap_method(original: Any, wrapper: Callable | Guarded, patch_name: str) -> Callable:
    """A plain function to store in place of the method ``original`` (a class ``__dict__`` entry).

    Calling it as ``instance.method(*args, **kwargs)`` or ``Class.method(instance, *args,
    **kwargs)`` calls ``wrapper(bound_original, instance, args, kwargs)`` (``wrapt``'s calling
    convention); a :class:`Guarded` wrapper only when its attribute test holds, ``original``
    directly otherwise. It carries ``original``'s name, docstring and signature, ``__wrapped__`` =
    ``original`` and :data:`PATCH_MARKER` = ``patch_name``.

    Raises:
        TypeError: a :class:`Guarded` wrapper for an ``original`` that is not a plain function
            (it is called with the instance as its first argument).
    """
    bind = original.__get__
    bypass = None
    if isinstance(wrapper, Guarded):
        patched, bypass = guarded_function(original, wrapper)
    else:
        def patched(self, *args, **kwargs):
            return wrapper(bind(self), self, args, kwargs)

    functools.update_wrapper(patched, original)  # also copies an inner wrapper's __dict__ ...
    setattr(patched, PATCH_MARKER, patch_name)  # ... so the marker is set after it
    setattr(patched, BYPASS_ATTR, bypass)
    return patched


class ShadowedMethod:
    """Within the block, ``instance.name`` is ``value``: an instance attribute shadowing the
    class's method, so the released code calling ``self.name(...)`` meets ``value``. On exit the
    instance's own attribute is back as it was (its value, or its absence). A class, not a
    generator context manager: it runs on admission paths.
    """

    __slots__ = ("state", "name", "value", "saved")
    _ABSENT = object()

    def __init__(self, instance: Any, name: str, value: Any) -> None:
        self.state, self.name, self.value = instance.__dict__, name, value

    def __enter__(self) -> None:
        self.saved = self.state.get(self.name, self._ABSENT)
        self.state[self.name] = self.value

    def __exit__(self, *exc_info: Any) -> None:
        if self.saved is self._ABSENT:
            del self.state[self.name]
        else:
            self.state[self.name] = self.saved


class PatchState(str, enum.Enum):
    """Where a patch stands. ``str`` values are what ``status --json`` prints."""

    APPLIED = "applied"
    APPLICABLE = "applicable"  # status() only: would be applied by apply()
    NOT_NEEDED = "not needed"
    REFUSED = "refused"
    REVERTED = "reverted"
    NOT_APPLIED = "not applied"  # revert() of a patch that was not applied


@dataclass(frozen=True)
class Target:
    """A method of a megatron-core class that a patch wraps or relies on.

    Attributes:
        module: dotted module name, e.g. ``megatron.core.inference.contexts.kv_block_allocator``.
        qualname: ``Class.method``, e.g. ``KVBlockAllocator.release_memory_blocks``; or, without a
            dot, a module global (a Triton kernel its launcher looks up at call time), whose owner
            is then the module.
    """

    module: str
    qualname: str

    @property
    def class_name(self) -> str:
        return self.qualname.split(".")[0]

    @property
    def attribute(self) -> str:
        return self.qualname.split(".")[-1]

    def owner(self) -> Any:
        """The class that holds the method (the module for a module global). Raises
        MegatronCoreNotFoundError if not importable."""
        module = mcore.import_module(self.module)
        return getattr(module, self.class_name) if "." in self.qualname else module

    def current(self) -> Any:
        """The object now stored under the attribute in the class ``__dict__`` (maybe a wrapper)."""
        return self.owner().__dict__[self.attribute]

    def original(self) -> Callable:
        """The unwrapped megatron-core function, even while one of our wrappers is installed."""
        function = self.current()
        while getattr(function, PATCH_MARKER, None) is not None:
            function = function.__wrapped__
        return function


@dataclass(frozen=True)
class PatchResult:
    """What happened to (or, from ``status()``, what would happen to) one patch.

    Attributes:
        patch: the patch's short name, e.g. ``release-refcount``.
        targets: ``module:Class.method`` of every function the patch wraps.
        state: see :class:`PatchState`.
        reason: one human sentence saying why.
        evidence: what the decision rests on (probe result, fingerprint comparison), or ``""``.
        fault: the ID of the fault the patch fixes (:attr:`Patch.fault`), e.g. ``"8"``, ``"H7"``.
    """

    patch: str
    targets: tuple[str, ...]
    state: PatchState
    reason: str
    evidence: str = ""
    fault: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "patch": self.patch,
            "fault": self.fault,
            "targets": list(self.targets),
            "state": self.state.value,
            "reason": self.reason,
            "evidence": self.evidence,
        }


def installed_patches(target: "Target") -> list[str]:
    """Names of the megatron-ext patches wrapping ``target``, outermost first.

    Several patches may wrap one function (``add_request`` carries two on 0.17/0.18); each
    wrapper wraps the one installed before it.
    """
    names, function = [], target.current()
    while (name := getattr(function, PATCH_MARKER, None)) is not None:
        names.append(name)
        function = function.__wrapped__
    return names


def defined(target: Target) -> bool:
    """Whether the target's class already exists, without importing anything."""
    module = sys.modules.get(target.module)
    return module is not None and target.class_name in vars(module)


def megatron_importing() -> bool:
    """Whether a megatron-core module is being imported right now.

    ``MEGATRON_EXT_AUTO`` applies the patches from a post-import hook of the dynamic context,
    which usually runs inside the import of the engine module: importing the engine module or
    the controller module from there fails on megatron-core's circular imports.
    """
    return any(name.startswith("megatron.") and getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()))


def fault_label(patch: type[Patch] | Patch) -> str:
    """``fault <ID> (<patch name>)``, e.g. ``fault 8 (weight-update-invalidation)``: how audits
    and failure messages name the fault a patch fixes."""
    return f"fault {patch.fault} ({patch.name})"


class Patch(ABC):
    """One runtime fix, declared by its subclass's class attributes plus :meth:`wrappers`.

    Attributes:
        name: short name used in status output and in the ``MEGATRON_EXT_SKIP`` variable; the
            class is named after it (``lru-leaf-first-eviction``: ``LruLeafFirstEvictionPatch``).
        fault: the ID of the fault it fixes, as the README's table of faults numbers them: ``"1"``
            to ``"9"`` for prefix caching, ``"H1"`` to ``"H10"`` for hybrid models
            (:func:`fault_label` spells it in audits and failure messages).
        fingerprints: release -> {``Class.method``: fingerprint} of every target and every
            function the wrapper relies on (:meth:`checked_functions`), recorded from the released
            wheels; read from
            :data:`~megatron_ext.fingerprints.FINGERPRINTS_FILE` by :attr:`name`.
        source_patched_targets: the functions the source patch of ``patches/`` changes for this
            fault; the default :meth:`needed` answers "not needed" when all of them are that code.
        source_patched_fingerprints: release -> {``Class.method``: fingerprint} of those functions
            after ``patches/`` (``scripts/record_fingerprints.py --source-patched``); read from
            :data:`~megatron_ext.fingerprints.FINGERPRINTS_FILE` like
            :attr:`fingerprints`.
        fault_evidence: what :meth:`needed` says of code that is not source-patched.
        waits_for_import: targets in modules megatron-core may still be importing when
            ``MEGATRON_EXT_AUTO`` applies the patches (its hook on the dynamic context runs inside
            the engine module's import): while one's class is not defined yet, :meth:`plan` says
            NOT_APPLIED and imports nothing (megatron-core's imports are circular); the start-up
            hook applies the patch again once that module has been imported.
        requires: names of the patches this fix is only correct with. ``apply()`` applies it only
            when each of them is applied with it or not needed (the installed code has that fix);
            otherwise it reports it NOT_APPLIED (REFUSED under ``strict=True``), naming the one
            missing.
    """

    name: ClassVar[str] = ""
    fault: ClassVar[str] = ""
    fingerprints: ClassVar[dict[str, dict[str, str]]] = RecordedFingerprints("released")
    source_patched_targets: ClassVar[tuple[Target, ...]] = ()
    source_patched_fingerprints: ClassVar[dict[str, dict[str, str]]] = RecordedFingerprints("source_patched")
    fault_evidence: ClassVar[str] = ""
    waits_for_import: ClassVar[tuple[Target, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._saved: dict[Target, Any] = {}

    @property
    def supported_releases(self) -> tuple[str, ...]:
        return tuple(sorted(self.fingerprints, key=lambda release: tuple(map(int, release.split(".")))))

    @abstractmethod
    def wrappers(self) -> dict[Target, Callable | Guarded | KernelLaunch]:
        """Target -> wrapper ``(wrapped, instance, args, kwargs)`` to install on it, maybe
        :class:`Guarded` (:func:`wrap_method`), or a :class:`KernelLaunch` for a Triton kernel
        (:func:`wrap_kernel`)."""

    def checked_functions(self) -> tuple[Target, ...]:
        """Every function whose fingerprint must match: the wrapped targets by default."""
        return tuple(self.wrappers())

    def needed(self) -> tuple[bool, str]:
        """Whether the installed code still has the fault, and the evidence for the answer: not
        needed where every function in :attr:`source_patched_targets` is the source-patched code
        of one release. Patches that probe the code's behaviour instead override this."""
        found = {t.qualname: fingerprint(t.original()) for t in self.source_patched_targets}
        releases = [r for r, fixed in self.source_patched_fingerprints.items() if found and fixed == found]
        if releases:
            names = ", ".join(f"{qualname.split('.')[-1]} {digest}" for qualname, digest in found.items())
            return False, f"fingerprints {names} are the source-patched code of patches/ for {', '.join(releases)}"
        return True, self.fault_evidence

    # -- state -------------------------------------------------------------------------------

    def target_names(self) -> tuple[str, ...]:
        return tuple(f"{t.module}:{t.qualname}" for t in self.wrappers())

    def is_applied(self) -> bool:
        """Whether every target carries this patch's wrapper, anywhere in a stack of wrappers."""
        return all(self.name in installed_patches(t) for t in self.wrappers())

    def result(self, state: PatchState, reason: str, evidence: str = "") -> PatchResult:
        return PatchResult(self.name, self.target_names(), state, reason, evidence, self.fault)

    def check(self, version: str) -> PatchResult | None:
        """Refusal result if the release or a target's code is not what this patch knows, else None."""
        supported = ", ".join(self.supported_releases)
        expected = self.fingerprints.get(mcore.base_release(version))
        if mcore.base_release(version) not in mcore.SUPPORTED_RELEASES:
            return self.result(
                PatchState.REFUSED,
                f"megatron-core {version} is not a supported release (supported: "
                f"{', '.join(mcore.SUPPORTED_RELEASES)}); install one of those, or force with "
                "MEGATRON_EXT_FORCE=1 / apply(force=True) after checking the target code yourself",
            )
        if not self.fingerprints:
            return self.result(
                PatchState.REFUSED,
                f"no fingerprints of {self.name} are recorded in megatron_ext/fingerprints.json; record "
                "them with scripts/record_fingerprints.py, or force with MEGATRON_EXT_FORCE=1 / "
                "apply(force=True) after checking the code yourself",
            )
        if expected is None:  # a supported release this patch was not written for
            return self.result(
                PatchState.REFUSED,
                f"{self.name} was written for megatron-core {supported}, not {version}; force "
                "with MEGATRON_EXT_FORCE=1 / apply(force=True) after checking the code yourself",
            )
        for target in self.checked_functions():
            try:
                found = fingerprint(target.original())
            except (OSError, TypeError) as exc:
                found = f"unreadable source ({exc})"
            if found != expected.get(target.qualname):
                return self.result(
                    PatchState.REFUSED,
                    f"{target.module}.{target.qualname} in megatron-core {version} is not the code "
                    f"this patch was written against (supported: {supported}); it was changed "
                    "locally or by another patch. Reinstall megatron-core, or force with "
                    "MEGATRON_EXT_FORCE=1 / apply(force=True) after checking the code yourself",
                    evidence=f"fingerprint {found}, expected {expected.get(target.qualname)}",
                )
        return None

    def import_pending(self) -> list[str]:
        """Modules of :attr:`waits_for_import` megatron-core is importing and has not defined the
        target class of yet (empty when nothing is pending). Imports nothing."""
        if not self.waits_for_import or not megatron_importing():
            return []
        return sorted({t.module for t in self.waits_for_import if not defined(t)})

    def plan(self, version: str, force: bool) -> PatchResult:
        """Decide without changing anything: APPLICABLE, APPLIED, NOT_NEEDED or REFUSED; NOT_APPLIED
        while a module of :attr:`waits_for_import` is mid-import."""
        pending = self.import_pending()
        if pending:
            loaded = "is not loaded yet" if len(pending) == 1 else "are not loaded yet"
            return self.result(PatchState.NOT_APPLIED, f"megatron-core is being imported and {' and '.join(pending)} "
                               f"{loaded}; MEGATRON_EXT_AUTO applies this patch then")
        if mcore.base_release(version) not in mcore.SUPPORTED_RELEASES and not force:
            # before touching the targets: an unsupported release may not even have them
            return self.check(version)  # refusal naming the supported releases
        if self.is_applied():
            return self.result(PatchState.APPLIED, "already applied by megatron-ext")
        try:
            needed, evidence = self.needed()
        except Exception as exc:  # a probe that cannot run says nothing about the fault
            needed, evidence = True, f"probe failed: {type(exc).__name__}: {exc}"
        if not needed:
            return self.result(
                PatchState.NOT_NEEDED, "the installed code does not have this fault", evidence
            )
        refusal = self.check(version)
        if refusal is not None and not force:
            return refusal
        reason = "the installed code has the fault and matches the recorded fingerprints"
        if refusal is not None:
            reason = f"FORCED despite refusal: {refusal.reason}"
        return self.result(PatchState.APPLICABLE, reason, evidence)

    # -- apply / revert ----------------------------------------------------------------------

    def settled(self, result: PatchResult) -> None:
        """Called by :func:`megatron_ext.apply` and :func:`megatron_ext.revert` with what they did
        to this patch (nothing to remember by default)."""

    def install(self) -> None:
        """Wrap every target. Callers hold the global lock and have checked :meth:`plan`."""
        for target, wrapper in self.wrappers().items():
            owner = target.owner()
            self._saved[target] = owner.__dict__[target.attribute]
            wrap = wrap_kernel if isinstance(wrapper, KernelLaunch) else wrap_method
            setattr(owner, target.attribute, wrap(self._saved[target], wrapper, self.name))

    def uninstall(self) -> bool:
        """Put back exactly the objects :meth:`install` replaced. Returns False if none were saved.

        Callers uninstall patches in the reverse order of installation, so that a target wrapped by
        several patches is unwound from the outermost wrapper in.

        Raises:
            RuntimeError: another wrapper was installed over this patch's own after it (a caller
                that broke the reverse order); nothing is changed.
        """
        if not self._saved:
            return False
        for target in self._saved:
            if getattr(target.current(), PATCH_MARKER, None) != self.name:
                raise RuntimeError(
                    f"cannot revert {self.name}: {target.qualname} is wrapped again by "
                    f"{installed_patches(target)[:1] or 'foreign code'}; revert that first"
                )
        for target, saved in self._saved.items():
            setattr(target.owner(), target.attribute, saved)
        self._saved.clear()
        return True
