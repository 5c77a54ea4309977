"""Interpreter start-up hook, run from ``megatron_ext_startup.pth`` when ``MEGATRON_EXT_AUTO=1``.

It imports neither torch nor megatron-core at start-up: it registers a post-import hook (wrapt)
so the patches are applied the moment megatron-core's dynamic inference context is imported.
That module imports the KV block allocator module itself, so both targets exist by then.
"""

from __future__ import annotations

from ..env import flag

AUTO_ENV = "MEGATRON_EXT_AUTO"
HOOKED_MODULE = "megatron.core.inference.contexts.dynamic_context"


def enabled() -> bool:
    return flag(AUTO_ENV)


def _apply_on_import(_module: object) -> None:
    from ..api import apply
    from ..announce import announce

    announce(apply())


def install() -> None:
    """Register the post-import hook; if the module is already imported wrapt calls it at once."""
    import wrapt

    wrapt.register_post_import_hook(_apply_on_import, HOOKED_MODULE)


if enabled():
    install()
