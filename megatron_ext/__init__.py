"""megatron-ext: prefix-caching fixes for an installed megatron-core, and a bit-identity harness.

``apply()`` applies the runtime patches the installed release needs, ``revert()`` restores the
originals, ``status()`` reports without changing anything. ``import megatron_ext.auto`` applies
them in one line; ``MEGATRON_EXT_AUTO=1`` applies them with no code change at all.
"""

from .api import apply, revert, status
from .errors import MegatronCoreNotFoundError, MegatronExtError, PatchRefusedError
from .patching import PatchResult, PatchState

__version__ = "0.1.0"

__all__ = [
    "apply",
    "revert",
    "status",
    "PatchResult",
    "PatchState",
    "MegatronExtError",
    "MegatronCoreNotFoundError",
    "PatchRefusedError",
]
