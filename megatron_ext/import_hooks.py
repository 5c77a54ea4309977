"""Post-import hooks with the standard library only: :func:`when_imported`.

``when_imported(name, hook)`` calls ``hook(module)`` once module ``name`` has been executed: at
once if it is imported already, else right after its code runs (inside the import statement that
first loads it, before that statement returns, so no thread sees the module before the hook has
run). This replaces ``wrapt.register_post_import_hook``, whose import costs about 90 ms of a
Python start-up of about 15 ms: ``MEGATRON_EXT_AUTO=1`` installs a hook in every process of a job.
It is megatron-ext's one post-import hook mechanism: the runtime patches use it too.

How: a :data:`sys.meta_path` finder (first in the list) answers only for the names it waits for.
It asks the finders after it for the module's real spec and wraps its loader; the wrapper runs the
real ``exec_module`` and then the hooks. The finder removes itself from ``sys.meta_path`` once no
hook is pending, so a process pays for it until the module is imported and not after.

Guarantees:

- each registered hook runs exactly once, also when several threads import the module at the same
  time (the import system lets one thread execute it; the hooks are taken off the list under a
  lock before they run);
- a module already imported gets its hooks at once; one being imported by another thread is
  waited for first, through the import system's own module lock, so the hook never sees a
  half-executed module from another thread (a hook registered on the importing thread itself,
  from inside the module's import, gets the module as it is then, as with wrapt);
- the module keeps its real loader (``__loader__`` and ``__spec__.loader``), so
  ``importlib.reload``, ``inspect.getsource`` and ``importlib.resources`` see what they would
  without the hook. A reload runs the module's code with that loader and does not run the hooks
  again (they ran once; the finder is gone by then).

A hook that raises makes the import raise, as with wrapt: the module's import fails and is not
retried by the hook (it has run).

Only the standard library is imported here, and only modules Python has loaded at start-up
already (``sys``, ``_thread``), so registering a hook costs microseconds.
"""

# No `from __future__ import annotations`: it imports the __future__ module, and this module runs
# at the start-up of every process under MEGATRON_EXT_AUTO=1 (each module there counts).
import _thread
import sys

#: The one finder of the process (created on first use).
_FINDER = None
_FINDER_LOCK = _thread.allocate_lock()


class _HookLoader:
    """Wraps a module's real loader: ``exec_module`` runs the real one, then the finder's hooks.

    Every other attribute (``get_source``, ``get_filename``, ``is_package``, ...) is the real
    loader's, so code that reads the loader while the module executes sees its usual answers.
    """

    def __init__(self, loader, finder: "_PostImportFinder", name: str):
        self.loader = loader
        self.finder = finder
        self.name = name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # Give the module its real loader back before its code runs: a reload, inspect.getsource
        # (linecache asks __loader__ for the source) and importlib.resources then see the real one,
        # and a reload cannot come back through this wrapper and run the hooks a second time.
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.finder.fire(self.name, module)

    def __getattr__(self, attribute: str):
        return getattr(self.loader, attribute)


class _PostImportFinder:
    """A meta path finder that wraps the loader of the modules hooks wait for (see module docstring)."""

    def __init__(self) -> None:
        self.hooks: dict = {}  # module name -> hooks not run yet
        self.lock = _thread.RLock()

    def find_spec(self, fullname: str, path=None, target=None):
        """The real spec of ``fullname`` with its loader wrapped, if a hook waits for it; else None
        (the import system then asks the next finder, as if this one were not there)."""
        if fullname not in self.hooks:  # every import of the process comes here: keep it a dict lookup
            return None
        spec = None
        for finder in list(sys.meta_path):  # what the import system would have found without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # nothing to wrap (not found, a namespace package, a legacy loader)
        spec.loader = _HookLoader(spec.loader, self, fullname)
        return spec

    def add(self, name: str, hook) -> None:
        with self.lock:
            self.hooks.setdefault(name, []).append(hook)
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def fire(self, name: str, module) -> None:
        """Run the hooks waiting for ``name`` (each once: they leave the list under the lock before
        they run); remove the finder when no hook is left."""
        with self.lock:
            hooks = self.hooks.pop(name, ())
            if not self.hooks and self in sys.meta_path:
                sys.meta_path.remove(self)
        for hook in hooks:
            hook(module)


def _finder() -> _PostImportFinder:
    global _FINDER
    with _FINDER_LOCK:
        if _FINDER is None:
            _FINDER = _PostImportFinder()
        return _FINDER


def when_imported(name: str, hook, wait: bool = True) -> None:
    """Call ``hook(module)`` once, when module ``name`` has been executed (at once if it has been).

    Args:
        name: the module's full dotted name, e.g. ``megatron.core.inference.contexts.dynamic_context``.
        hook: called with the module object: on the thread that executed the module, inside the
            import statement that loaded it; or, if it was imported already, here, before returning.
        wait: wait for another thread's import of ``name`` in flight (below). False for a caller
            holding a lock that import may need: the hook then meets a module another thread is
            still executing as it is (at once), or, for an import that had passed the finder
            already, never runs; such a caller needs another way to catch up (a runtime patch's
            next call, say).

    With ``wait`` it may wait for another thread's import of ``name`` to finish: do not call it so
    while holding a lock that code run by that import could need (an ``apply()`` lock taken by an
    import hook, say), or both threads wait forever. Start-up, where it is called, holds none.

    Raises:
        Whatever ``hook`` raises when it runs at once (the module was imported already).
    """
    finder = _finder()
    # Registered first, then wait for any import of `name` in flight: an import that had passed the
    # finder before this line still holds the module's import lock, so once the lock is free the
    # module is either in sys.modules, executed (hook run below), or not imported yet (the finder
    # will see the hook). Without the wait, a thread between its find_spec and its sys.modules entry
    # would leave the hook waiting forever.
    finder.add(name, hook)
    if wait:
        _wait_for_import(name)
    module = sys.modules.get(name)
    if module is not None:
        finder.fire(name, module)


def _wait_for_import(name: str) -> None:
    """Return once no other thread is importing module ``name`` (at once on the importing thread).

    Uses the import system's own per-module lock, through the function it uses for the same wait
    (``_frozen_importlib._lock_unlock_module``, present in every CPython 3 since 3.3; the frozen
    module is always loaded). Should it ever be missing, importing the module waits for the same
    lock, but only for a module already in ``sys.modules``.
    """
    wait = getattr(sys.modules.get("_frozen_importlib"), "_lock_unlock_module", None)
    if wait is not None:
        wait(name)
        return
    module = sys.modules.get(name)
    if getattr(getattr(module, "__spec__", None), "_initializing", False):
        import importlib

        importlib.import_module(name)


def pending(name: str) -> int:
    """How many hooks still wait for module ``name`` (0 once they ran)."""
    finder = _FINDER
    if finder is None:
        return 0
    with finder.lock:
        return len(finder.hooks.get(name, ()))
