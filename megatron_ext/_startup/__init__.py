"""Interpreter start-up hook, run from ``megatron_ext_startup.pth`` when ``MEGATRON_EXT_AUTO=1``.

It imports neither torch nor megatron-core nor wrapt at start-up: it registers a post-import hook
(:func:`megatron_ext.import_hooks.when_imported`, standard library only) so the patches
are applied the moment megatron-core's dynamic inference context is imported (at once if it is
imported already). That module imports the KV block allocator module itself, so both targets exist
by then. wrapt, torch and the patches load inside the hook, with megatron-core. The
engine module usually imports the context half-way through its own import: the patches on the
engine (``top-n-prefill-chunks``, ``routing-evicted-requests``, ``mamba-aligned-chunks``) then wait, and a second hook applies it when the engine module
is imported (likewise ``mamba-conv-carry``, ``mamba-decode-no-dummy`` and ``mamba-decode-a-cache`` and the Mamba mixer module,
which imports the decode kernel's module, and the MLA patches and the multi-latent attention module); each patch's line is
printed again only when its state changed.
"""

# No `from __future__ import annotations`: it imports the __future__ module, and this module runs
# at the start-up of every process under MEGATRON_EXT_AUTO=1 (each module there counts).
import os

from ..import_hooks import when_imported

AUTO_ENV = "MEGATRON_EXT_AUTO"
HOOKED_MODULE = "megatron.core.inference.contexts.dynamic_context"
ENGINE_MODULE = "megatron.core.inference.engines.dynamic_engine"
#: hybrid models: the Mamba mixer (``mamba-conv-carry``, ``mamba-decode-no-dummy`` and ``mamba-decode-a-cache`` wait for it,
#: like the engine patch)
MAMBA_MIXER_MODULE = "megatron.core.ssm.mamba_mixer"
#: MLA models: ``mla-decode-flag`` and ``mla-absorbed-weights`` wait for the multi-latent attention module (imported with
#: the layer specs, maybe while the patches first apply)
MLA_MODULE = "megatron.core.transformer.multi_latent_attention"
#: patch name -> state last printed, so the engine module's hook prints only what it changed
_ANNOUNCED: dict[str, str] = {}

# The flag values of megatron_ext.env.TRUE_VALUES, repeated so start-up does not import that module.
_TRUE_VALUES = ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether ``MEGATRON_EXT_AUTO`` is on (as :func:`megatron_ext.env.flag` reads it)."""
    return os.environ.get(AUTO_ENV, "").strip().lower() in _TRUE_VALUES


def _apply_on_import(_module: object) -> None:
    from ..announce import announce, apply_announced

    changed = [r for r in apply_announced() if _ANNOUNCED.get(r.patch) != r.state.value]
    _ANNOUNCED.update((r.patch, r.state.value) for r in changed)
    announce(changed)


def install() -> None:
    """Register the post-import hooks; for a module imported already the patches apply at once."""
    when_imported(HOOKED_MODULE, _apply_on_import)
    when_imported(ENGINE_MODULE, _apply_on_import)
    when_imported(MAMBA_MIXER_MODULE, _apply_on_import)
    when_imported(MLA_MODULE, _apply_on_import)


if enabled():
    install()
