"""Interpreter start-up hook, run from ``megatron_ext_startup.pth`` when ``MEGATRON_EXT_AUTO=1``.

It imports neither torch nor megatron-core at start-up: it registers a post-import hook (wrapt)
so the patches are applied the moment megatron-core's dynamic inference context is imported.
That module imports the KV block allocator module itself, so both targets exist by then. The
engine module usually imports the context half-way through its own import: the patch on the
engine (``top-n-prefill-chunks``) then waits, and a second hook applies it when the engine module
is imported; each patch's line is printed again only when its state changed.
"""

from __future__ import annotations

from ..env import flag

AUTO_ENV = "MEGATRON_EXT_AUTO"
HOOKED_MODULE = "megatron.core.inference.contexts.dynamic_context"
ENGINE_MODULE = "megatron.core.inference.engines.dynamic_engine"
#: patch name -> state last printed, so the engine module's hook prints only what it changed
_ANNOUNCED: dict[str, str] = {}


def enabled() -> bool:
    return flag(AUTO_ENV)


def _apply_on_import(_module: object) -> None:
    from ..api import apply
    from ..announce import announce

    changed = [r for r in apply() if _ANNOUNCED.get(r.patch) != r.state.value]
    _ANNOUNCED.update((r.patch, r.state.value) for r in changed)
    announce(changed)


def install() -> None:
    """Register the post-import hooks; for a module already imported wrapt calls the hook at once."""
    import wrapt

    wrapt.register_post_import_hook(_apply_on_import, HOOKED_MODULE)
    wrapt.register_post_import_hook(_apply_on_import, ENGINE_MODULE)


if enabled():
    install()
