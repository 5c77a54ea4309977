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

from . import foreign, mcore
from .errors import MegatronExtError, RevertBlockedError
from .fingerprints import ABSENT, RecordedFingerprints, TreeMatch, fingerprint, match_trees, tree_labels
from .guards import BYPASS_ATTR, Guarded, guarded_function

#: Attribute set on every wrapper megatron-ext installs, naming the patch that installed it. For
#: people reading a wrapper; megatron-ext itself goes by :data:`_INSTALLED_WRAPPERS` (identity),
#: because ``functools.wraps`` and ``wrapt`` proxies make a foreign wrapper show the marker too.
PATCH_MARKER = "_self_megatron_ext_patch"

#: ``id(wrapper) -> (patch name, wrapper)`` of every wrapper :meth:`Patch.install` put in place and
#: :meth:`Patch.uninstall` has not removed: what was applied, recorded when it was applied.
_INSTALLED_WRAPPERS: dict[int, tuple[str, Any]] = {}


def installed_by(obj: Any) -> str | None:
    """The name of the patch that installed ``obj``, or None if megatron-ext did not install it."""
    entry = _INSTALLED_WRAPPERS.get(id(obj))
    return entry[0] if entry is not None and entry[1] is obj else None


def _ours_or_megatron(obj: Any) -> bool:
    return installed_by(obj) is not None or foreign.defined_in_megatron(obj)


def wrapper_chain(target: "Target") -> list[Any]:
    """The objects from ``target``'s class attribute down to megatron-core's function, outermost
    first: megatron-ext's wrappers (each calls its ``__wrapped__``), foreign wrappers found over
    or between them (:func:`megatron_ext.foreign.path_to`), and last the function under them all,
    which may be a foreign wrapper megatron-ext cannot see through."""
    layers, obj = [], target.current()
    while True:
        layers.append(obj)
        if installed_by(obj) is not None:
            obj = obj.__wrapped__
            continue
        if not _INSTALLED_WRAPPERS or foreign.defined_in_megatron(obj):
            return layers
        path = foreign.path_to(obj, lambda o: installed_by(o) is not None, opaque=_ours_or_megatron)
        if path is None:
            return layers
        obj = path[-1]


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
        """The function under megatron-ext's wrappers and the foreign ones over them: megatron-core's
        (or, before :func:`megatron_ext.apply`, a foreign wrapper of it, :func:`wrapper_chain`)."""
        return wrapper_chain(self)[-1]


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
    """Names of the megatron-ext patches whose wrappers ``target``'s attribute still reaches,
    outermost first (foreign wrappers between them are passed over, :func:`wrapper_chain`).

    Several patches may wrap one function (``add_request`` carries two on 0.17/0.18); each
    wrapper wraps the one installed before it.
    """
    return [name for obj in wrapper_chain(target) if (name := installed_by(obj)) is not None]


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
            to ``"9"`` for prefix caching, ``"H1"`` to ``"H11"`` for hybrid models, ``"M1"``,
            ``"M2"`` for MLA, ``"R1"`` to ``"R3"`` for MoE routing replay, ``"S1"`` for speculative
            decoding (:func:`fault_label` spells it in audits and failure messages).
        faulty_fingerprints: known tree -> {``Class.method``: fingerprint} of every target and
            every function the wrapper relies on (:meth:`checked_functions`), in each tree that has
            the fault (a PyPI release or a Megatron-LM commit,
            :class:`~megatron_ext.fingerprints.KnownTree`); read from
            :data:`~megatron_ext.fingerprints.FINGERPRINTS_FILE` by :attr:`name`. Code equal to one
            of them gets the patch.
        fixed_fingerprints: the same, in each known tree that does not have the fault (fixed
            upstream, or a function missing there: ``"absent"``). Code equal to one of them is
            "not needed".
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
    faulty_fingerprints: ClassVar[dict[str, dict[str, str]]] = RecordedFingerprints("faulty")
    fixed_fingerprints: ClassVar[dict[str, dict[str, str]]] = RecordedFingerprints("fixed")
    source_patched_targets: ClassVar[tuple[Target, ...]] = ()
    source_patched_fingerprints: ClassVar[dict[str, dict[str, str]]] = RecordedFingerprints("source_patched")
    fault_evidence: ClassVar[str] = ""
    waits_for_import: ClassVar[tuple[Target, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._saved: dict[Target, Any] = {}  # what install() replaced, put back by uninstall()
        self._installed: dict[Target, Any] = {}  # what install() put in its place

    @abstractmethod
    def wrappers(self) -> dict[Target, Callable | Guarded | KernelLaunch]:
        """Target -> wrapper ``(wrapped, instance, args, kwargs)`` to install on it, maybe
        :class:`Guarded` (:func:`wrap_method`), or a :class:`KernelLaunch` for a Triton kernel
        (:func:`wrap_kernel`)."""

    def checked_functions(self) -> tuple[Target, ...]:
        """Every function whose fingerprint must match: the wrapped targets by default."""
        return tuple(self.wrappers())

    def needed(self) -> tuple[bool, str]:
        """The probe :meth:`plan` runs on code that matches no known tree: whether it still has the
        fault, and the evidence for the answer. Not needed where every function in
        :attr:`source_patched_targets` is the source-patched code of one release; patches that
        probe the code's behaviour add to this."""
        found = {t.qualname: fingerprint(t.original()) for t in self.source_patched_targets}
        releases = [r for r, fixed in self.source_patched_fingerprints.items() if found and fixed == found]
        if releases:
            names = ", ".join(f"{qualname.split('.')[-1]} {digest}" for qualname, digest in found.items())
            return False, f"fingerprints {names} are the source-patched code of patches/ for {', '.join(releases)}"
        return True, self.fault_evidence

    # -- state -------------------------------------------------------------------------------

    def target_names(self) -> tuple[str, ...]:
        return tuple(f"{t.module}:{t.qualname}" for t in self.wrappers())

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` put this patch's wrappers in place and :meth:`uninstall` has not
        removed them (whatever foreign code did since)."""
        return bool(self._installed)

    def is_applied(self) -> bool:
        """Whether this patch is installed and every target still reaches its wrapper, under
        foreign wrappers or not."""
        return self.installed and all(self._layers_above(target) is not None for target in self._installed)

    def wrapped_over(self) -> dict[Target, list[str]]:
        """Target -> the foreign wrappers over this patch's wrapper (``module:qualname``, outermost
        first), for the targets that have any and still reach it."""
        over = {}
        for target in self._installed:
            layers = self._layers_above(target)
            names = [foreign.describe(obj) for obj in layers or () if installed_by(obj) is None]
            if names:
                over[target] = names
        return over

    def bypassed(self) -> dict[Target, str]:
        """Target -> the foreign object (``module:qualname``) its attribute holds now, for the
        targets from which this patch's wrapper is no longer reachable: foreign code replaced it
        without calling through, so the fix does not run there."""
        lost = {target: target.current() for target in self._installed if self._layers_above(target) is None}
        # megatron-core's own function back in place (its module reloaded) is "not applied", not foreign
        return {target: foreign.describe(obj) for target, obj in lost.items() if not foreign.defined_in_megatron(obj)}

    def bypass_summary(self) -> str:
        """:meth:`bypassed` in words (``"Cls.m is now module:qualname; ..."``), or ``""``."""
        return "; ".join(f"{target.qualname} is now {name}" for target, name in self.bypassed().items())

    def _layers_above(self, target: Target) -> list[Any] | None:
        """The objects over this patch's wrapper of ``target``, outermost first; None if unreachable."""
        layers, mine = wrapper_chain(target), self._installed[target]
        return next((layers[:i] for i, obj in enumerate(layers) if obj is mine), None)

    def installed_result(self) -> PatchResult | None:
        """What :meth:`plan` says of an installed patch: APPLIED, naming foreign wrappers over it,
        or REFUSED where foreign code bypasses it (apply() cannot put it back over that code);
        None where megatron-core's own function is back (planned as if never installed)."""
        where = self.bypass_summary()
        if where:
            return self.result(PatchState.REFUSED, f"applied, but foreign code replaced megatron-ext's wrapper "
                               f"without calling through to it, so the fix does not run ({where}); make that code "
                               "call the function it replaced, or remove it")
        if not self.is_applied():
            return None
        over = self.wrapped_over()
        if over:
            names = ", ".join(dict.fromkeys(name for names in over.values() for name in names))
            return self.result(PatchState.APPLIED, f"already applied by megatron-ext (wrapped by foreign code: {names})")
        return self.result(PatchState.APPLIED, "already applied by megatron-ext")

    def result(self, state: PatchState, reason: str, evidence: str = "") -> PatchResult:
        return PatchResult(self.name, self.target_names(), state, reason, evidence, self.fault)

    def match(self) -> TreeMatch:
        """Which known trees the installed code of :meth:`checked_functions` is."""
        found = {target.qualname: self.found_fingerprint(target) for target in self.checked_functions()}
        return match_trees(found, self.faulty_fingerprints, self.fixed_fingerprints)

    @staticmethod
    def found_fingerprint(target: Target) -> str:
        """The installed code's fingerprint of ``target`` (:func:`~megatron_ext.fingerprints.fingerprint`
        of the function under any wrappers); :data:`~megatron_ext.fingerprints.ABSENT` when its
        module, class or attribute does not exist; ``"unreadable source (...)"`` without source."""
        try:
            return fingerprint(target.original())
        except (AttributeError, KeyError, MegatronExtError):  # no such class, method or module here
            return ABSENT
        except (OSError, TypeError) as exc:
            return f"unreadable source ({exc})"

    def _unknown_code(self, version: str, match: TreeMatch) -> PatchResult:
        """The refusal for checked functions that are no known tree's code (forceable)."""
        differing = match.differing or tuple(match.found)
        unseen = next((why for name in differing if (why := self._unseen_wrapper(self._target(name), version))), "")
        nearest = (f" (nearest known tree: {tree_labels([match.nearest])}, where the others match)"
                   if match.nearest and len(differing) < len(match.found) else "")
        names = ", ".join(f"{self._target(name).module}.{name}" for name in differing)
        reason = unseen or (f"{names} in megatron-core {version}: this code is not one megatron-ext has checked"
                            f"{nearest}; it was changed locally, by another patch or upstream. Use a known tree "
                            "(`megatron-ext status --trees`), or force with MEGATRON_EXT_FORCE=1 / apply(force=True) "
                            "after checking the code yourself")
        return self.result(PatchState.REFUSED, reason, evidence=self._evidence(match, differing))

    def _unexpectedly_absent(self, match: TreeMatch) -> tuple[str, ...]:
        """The checked functions the installed tree lacks that every known tree has. One that some
        known tree lacks too (0.17 has no ``reconstruct_routing_from_blocks``, main no
        ``_ssm_prefill``) is not missing code: such a tree, source-patched, is left to the probe."""
        recorded = [*self.faulty_fingerprints.values(), *self.fixed_fingerprints.values()]
        return tuple(name for name in match.absent if not any(prints.get(name) == ABSENT for prints in recorded))

    def _target(self, qualname: str) -> Target:
        return next(target for target in self.checked_functions() if target.qualname == qualname)

    @staticmethod
    def _evidence(match: TreeMatch, names: tuple[str, ...] | None = None) -> str:
        return "fingerprints " + ", ".join(f"{name} {match.found[name]}" for name in names or match.found)

    @staticmethod
    def _unseen_wrapper(target: Target, version: str) -> str:
        """The refusal for a target under a foreign wrapper that hides the code it wraps (no
        ``__wrapped__``); ``""`` for any other mismatch."""
        try:
            function = target.original()
        except (AttributeError, KeyError, MegatronExtError):
            return ""
        if foreign.defined_in_megatron(function) or getattr(function, "__wrapped__", None) is not None:
            return ""
        return (f"{target.module}.{target.qualname} in megatron-core {version} is wrapped by foreign code {foreign.describe(function)}, which "
                "hides the code it wraps: give that wrapper functools.wraps (a __wrapped__ chain; wrapt's wrappers "
                "have one) so megatron-ext can check the code under it, or install it after megatron_ext.apply()")

    def import_pending(self) -> list[str]:
        """Modules of :attr:`waits_for_import` megatron-core is importing and has not defined the
        target class of yet (empty when nothing is pending). Imports nothing."""
        if not self.waits_for_import or not megatron_importing():
            return []
        return sorted({t.module for t in self.waits_for_import if not defined(t)})

    def plan(self, version: str, force: bool) -> PatchResult:
        """Decide without changing anything, from the installed code (the version only names it):
        APPLICABLE where the checked functions are a known faulty tree's, NOT_NEEDED where they are
        a known fixed tree's; otherwise the probe (:meth:`needed`) decides NOT_NEEDED, and code it
        finds faulty is REFUSED (APPLICABLE when forced). A missing function that every known tree
        has, or a probe that fails, is REFUSED even when forced. APPLIED if installed; NOT_APPLIED while a module of
        :attr:`waits_for_import` is mid-import."""
        pending = self.import_pending()
        if pending:
            loaded = "is not loaded yet" if len(pending) == 1 else "are not loaded yet"
            return self.result(PatchState.NOT_APPLIED, f"megatron-core is being imported and {' and '.join(pending)} "
                               f"{loaded}; MEGATRON_EXT_AUTO applies this patch then")
        installed = self.installed_result() if self.installed else None
        if installed is not None:
            return installed
        match = self.match()
        if match.faulty and not match.fixed:
            return self.result(PatchState.APPLICABLE, f"the installed code has this fault: megatron-core {version}'s "
                               f"targets match {tree_labels(match.faulty)}", self._evidence(match))
        if match.fixed and not match.faulty:
            return self.result(PatchState.NOT_NEEDED, f"the installed code does not have this fault: megatron-core "
                               f"{version}'s targets match {tree_labels(match.fixed)}", self._evidence(match))
        unexpected = self._unexpectedly_absent(match)
        if unexpected:
            names = ", ".join(f"{self._target(name).module}.{name}" for name in unexpected)
            return self.result(PatchState.REFUSED, f"{names} does not exist in megatron-core {version}: this code is not "
                               "one megatron-ext has checked, and the patch has nothing to wrap there",
                               self._evidence(match))
        try:
            needed, evidence = self.needed()
        except Exception as exc:  # a probe that cannot run says nothing about the fault
            return self.result(PatchState.REFUSED, f"this code is not one megatron-ext has checked and the patch's probe "
                               f"failed on it ({type(exc).__name__}: {exc})", self._evidence(match))
        if not needed:
            return self.result(PatchState.NOT_NEEDED, "the installed code does not have this fault", evidence)
        refusal = self._unknown_code(version, match)
        if not force:
            return refusal
        return self.result(PatchState.APPLICABLE, f"FORCED despite refusal: {refusal.reason}", evidence)

    # -- apply / revert ----------------------------------------------------------------------

    def settled(self, result: PatchResult) -> None:
        """Called by :func:`megatron_ext.apply` and :func:`megatron_ext.revert` with what they did
        to this patch (nothing to remember by default)."""

    def install(self) -> None:
        """Wrap every target, recording what it replaced and what it installed. Callers hold the
        global lock and have checked :meth:`plan`."""
        for target, wrapper in self.wrappers().items():
            owner = target.owner()
            self._saved[target] = owner.__dict__[target.attribute]
            wrap = wrap_kernel if isinstance(wrapper, KernelLaunch) else wrap_method
            installed = wrap(self._saved[target], wrapper, self.name)
            self._installed[target] = installed
            _INSTALLED_WRAPPERS[id(installed)] = (self.name, installed)
            setattr(owner, target.attribute, installed)

    def revert_blocker(self, outer_patches_first: bool = False) -> str:
        """Why :meth:`uninstall` cannot restore a target now (``""`` if it can): a foreign wrapper
        over this patch's, or foreign code that replaced it. With ``outer_patches_first``, other
        megatron-ext wrappers over it do not count (:func:`megatron_ext.revert` unwinds those first)."""
        for target in self._installed:
            layers = self._layers_above(target)
            if layers is None:
                return (f"cannot revert {self.name}: {target.qualname} was replaced by foreign code "
                        f"{foreign.describe(target.current())} without calling through to megatron-ext's "
                        "wrapper; restoring megatron-core's function would drop that code: remove it first")
            blocking = [obj for obj in layers if not (outer_patches_first and installed_by(obj) is not None)]
            if blocking:
                name = installed_by(blocking[0]) or f"foreign code {foreign.describe(blocking[0])}"
                return f"cannot revert {self.name}: {target.qualname} is wrapped again by {name}; revert that first"
        return ""

    def uninstall(self) -> bool:
        """Put back exactly the objects :meth:`install` replaced. Returns False if none were saved.

        Callers uninstall patches in the reverse order of installation, so that a target wrapped by
        several patches is unwound from the outermost wrapper in.

        Raises:
            RevertBlockedError: another wrapper was installed over this patch's own after it
                (foreign code, or a caller that broke the reverse order), or foreign code replaced
                it (:meth:`revert_blocker`); nothing is changed.
        """
        if not self._saved:
            return False
        blocker = self.revert_blocker()
        if blocker:
            raise RevertBlockedError(blocker)
        for target, saved in self._saved.items():
            setattr(target.owner(), target.attribute, saved)
            _INSTALLED_WRAPPERS.pop(id(self._installed[target]), None)
        self._saved.clear()
        self._installed.clear()
        return True
