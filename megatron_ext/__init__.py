"""megatron-ext: prefix-caching fixes for an installed megatron-core, and a bit-identity harness.

``apply()`` applies the runtime patches the installed release needs, ``revert()`` restores the
originals, ``status()`` reports without changing anything; ``invalidate_prefix_cache(engine)``
flushes an engine's prefix cache after a weight update the engine cannot see. ``import megatron_ext.auto`` applies
them in one line; ``MEGATRON_EXT_AUTO=1`` applies them with no code change at all.

Importing this package imports nothing at all (not even ``typing``): the names below load on first
use (PEP 562), so the start-up hook, ``megatron-ext --help`` and argument errors never pay for
torch or megatron-core.
"""

# No `from __future__ import annotations`: it imports the __future__ module, and this module runs
# at the start-up of every process under MEGATRON_EXT_AUTO=1 (each module there counts).
__version__ = "0.1.0"

# Public name -> submodule that defines it; loaded on first attribute access.
_LAZY = {
    "apply": "api",
    "revert": "api",
    "status": "api",
    "invalidate_prefix_cache": "api",
    "token_weight_versions": "api",
    "TokenWeightVersions": "patches.weight_versions",
    "WeightVersionsNotRecorded": "patches.weight_versions",
    "InvalidationResult": "patches.weight_update_invalidation",
    "PatchResult": "patching",
    "PatchState": "patching",
    "MegatronExtError": "errors",
    "MegatronCoreNotFoundError": "errors",
    "PatchRefusedError": "errors",
    "UnsupportedReleaseError": "errors",
    "WeightUpdatePatchNotApplied": "errors",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> object:
    """Load a public name from its submodule on first access (PEP 562).

    Raises:
        AttributeError: ``name`` is not a public name of megatron_ext.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_ext' has no attribute {name!r}")
    import importlib  # here, not at the top: MEGATRON_EXT_AUTO=1 imports this package in every process

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
