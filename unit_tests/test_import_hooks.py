"""``megatron_ext.import_hooks.when_imported``: the standard-library post-import hook that
``MEGATRON_EXT_AUTO=1`` registers at start-up (in place of wrapt's).

Each test writes a fresh module into a temporary directory on ``sys.path`` (a unique name, so no
test sees another's), registers hooks and imports it: the hook runs once with the executed module,
at once when it is imported already, exactly once with eight threads importing together, not again
under ``importlib.reload``; the module keeps its real loader, and the finder leaves
``sys.meta_path`` once nothing waits.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import sys
import threading
import time

import pytest

from megatron_ext import import_hooks
from megatron_ext.import_hooks import pending, when_imported

_NAMES = itertools.count()


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    """``make_module(body) -> name``: a new module ``name`` (in a new package on ``sys.path``), not
    imported yet, defining ``answer()``. Its code first appends its name to :data:`EXECUTIONS`, so a
    test counts how often the code ran, then runs ``body``.

    The test gets a finder of its own: a runtime patch applied earlier in this process may have left
    the process's finder waiting for a module not imported yet (fault 8's refit module), and the
    tests check when *their* finder leaves ``sys.meta_path``."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(import_hooks, "_FINDER", None)
    created = []

    def make(body: str = "") -> str:
        package = f"hookpkg{next(_NAMES)}_{tmp_path.name.replace('-', '_')}"
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "target.py").write_text(
            f"from unit_tests.test_import_hooks import EXECUTIONS\nEXECUTIONS.append(__name__)\n{body}\n"
            "def answer():\n    return 42\n")
        name = f"{package}.target"
        created.append(package)
        return name

    yield make
    if import_hooks._FINDER in sys.meta_path:  # a hook left waiting (a module that never came)
        sys.meta_path.remove(import_hooks._FINDER)
    for package in created:
        for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[key]


EXECUTIONS: list[str] = []
#: set by a module's code once it runs / waited for by it (a module another thread is importing)
STARTED, GATE = threading.Event(), threading.Event()


def finder_installed() -> bool:
    """Whether this test's finder (see ``make_module``) is on ``sys.meta_path``."""
    return import_hooks._FINDER is not None and import_hooks._FINDER in sys.meta_path


def test_hook_runs_once_after_the_module_executed_and_the_finder_leaves(make_module):
    name = make_module()
    seen = []
    when_imported(name, lambda module: seen.append((module.__name__, module.answer(), EXECUTIONS.count(name))))
    assert seen == [] and pending(name) == 1 and finder_installed()
    module = importlib.import_module(name)
    assert seen == [(name, 42, 1)]  # called with the executed module, its code ran once
    assert pending(name) == 0 and not finder_installed()
    importlib.import_module(name)
    assert len(seen) == 1


def test_module_keeps_its_real_loader(make_module):
    name = make_module()
    when_imported(name, lambda module: None)
    module = importlib.import_module(name)
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__.loader is module.__loader__
    assert inspect.getsource(module.answer) == "def answer():\n    return 42\n"  # linecache asks __loader__


def test_already_imported_module_gets_the_hook_at_once(make_module):
    name = make_module()
    module = importlib.import_module(name)
    seen = []
    when_imported(name, seen.append)
    assert seen == [module]
    assert pending(name) == 0 and not finder_installed()
    assert EXECUTIONS.count(name) == 1  # not imported again


def test_reload_runs_the_module_again_but_not_the_hook(make_module):
    name = make_module()
    seen = []
    when_imported(name, seen.append)
    module = importlib.import_module(name)
    reloaded = importlib.reload(module)
    assert reloaded is module and EXECUTIONS.count(name) == 2  # the code ran again
    assert seen == [module]  # the hook did not
    assert type(module.__loader__).__name__ == "SourceFileLoader"


def test_reload_while_other_hooks_wait_leaves_them_waiting(make_module):
    hooked, other = make_module(), make_module()
    seen = []
    module = importlib.import_module(hooked)
    when_imported(other, seen.append)
    importlib.reload(module)  # goes through the finder, which answers only for `other`
    assert seen == [] and pending(other) == 1
    importlib.import_module(other)
    assert [m.__name__ for m in seen] == [other]


def test_eight_threads_importing_together_run_the_hook_exactly_once(make_module):
    # the module sleeps while it executes, so every thread is inside `import` at the same time
    name = make_module("import time\ntime.sleep(0.3)")
    calls = []
    when_imported(name, lambda module: (time.sleep(0.1), calls.append(threading.get_ident())))
    barrier = threading.Barrier(8)
    after_import = []

    def importer():
        barrier.wait()
        importlib.import_module(name)
        after_import.append(len(calls))  # what this thread saw when its import returned

    threads = [threading.Thread(target=importer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(calls) == 1 and EXECUTIONS.count(name) == 1
    assert after_import == [1] * 8  # no thread got the module before its hook had run


def test_hook_registered_while_another_thread_imports_waits_for_it(make_module):
    name = make_module("import time\ntime.sleep(0.5)")
    early, late = [], []
    when_imported(name, lambda module: early.append(module.answer()))
    importer = threading.Thread(target=importlib.import_module, args=(name,))
    importer.start()
    deadline = time.monotonic() + 10
    while name not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.01)  # the other thread is executing the module now
    when_imported(name, lambda module: late.append(module.answer()))  # half-executed: waits for it
    importer.join(timeout=30)
    assert early == [42] and late == [42]  # each once, each saw the whole module
    assert pending(name) == 0 and not finder_installed()


def test_many_threads_registering_while_the_module_imports_each_run_once(make_module):
    name = make_module("import time\ntime.sleep(0.2)")
    calls: list[int] = []
    barrier = threading.Barrier(9)

    def register(index):
        barrier.wait()
        when_imported(name, lambda module: calls.append(index))

    def importer():
        barrier.wait()
        importlib.import_module(name)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(8)] + [threading.Thread(target=importer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(calls) == list(range(8))
    assert pending(name) == 0 and not finder_installed()


def test_a_hook_that_raises_fails_that_import_and_does_not_run_again(make_module):
    name = make_module()
    calls = []

    def broken(module):
        calls.append(module)
        raise RuntimeError("hook failed")

    when_imported(name, broken)
    with pytest.raises(RuntimeError, match="hook failed"):
        importlib.import_module(name)
    assert name not in sys.modules  # the import failed as a whole
    importlib.import_module(name)  # a second import executes the module without the hook
    assert len(calls) == 1 and EXECUTIONS.count(name) == 2


def test_missing_module_is_left_to_the_import_system(make_module):
    name = make_module() + "_absent"
    when_imported(name, lambda module: pytest.fail("hook ran for a module that does not exist"))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
    assert pending(name) == 1 and finder_installed()  # still waiting: the module may appear later


def test_without_wait_it_returns_while_another_thread_still_executes_the_module(make_module):
    # fault 8 registers under apply()'s lock, which that import may need (MEGATRON_EXT_AUTO):
    # waiting could deadlock; the patch catches up at its next call instead
    name = make_module("from unit_tests.test_import_hooks import STARTED, GATE\nSTARTED.set()\nGATE.wait(30)")
    STARTED.clear(), GATE.clear()
    importer = threading.Thread(target=importlib.import_module, args=(name,))
    importer.start()
    assert STARTED.wait(30)
    seen = []
    when_imported(name, lambda module: seen.append(hasattr(module, "answer")), wait=False)
    returned_mid_import = not GATE.is_set()
    GATE.set()
    importer.join(timeout=30)
    assert returned_mid_import
    assert seen == [False]  # ran at once, on the module as it was: answer() not defined yet
    assert pending(name) == 0 and not finder_installed()
