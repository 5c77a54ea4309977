"""Exceptions raised by megatron-ext. Each message names the problem and the fix."""


class MegatronExtError(Exception):
    """Base class of every error megatron-ext raises on purpose."""


class MegatronCoreNotFoundError(MegatronExtError):
    """megatron-core cannot be imported, so there is nothing to patch."""


class PatchRefusedError(MegatronExtError):
    """A patch was refused: unsupported megatron-core release or changed target code.

    Raised by ``apply(strict=True)``; ``apply()`` without ``strict`` reports the refusal in its
    results instead.
    """


class DeviceUnavailableError(MegatronExtError, RuntimeError):
    """A run asked for a device this machine does not have (``--device cuda`` without CUDA).

    Also a ``RuntimeError``, as it was before it had its own class.
    """


class WeightUpdatePatchNotApplied(MegatronExtError, RuntimeError):
    """``invalidate_prefix_cache`` was called while the ``weight-update-invalidation`` patch is
    not applied (``megatron_ext.apply()`` installs it)."""
