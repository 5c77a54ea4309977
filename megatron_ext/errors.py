"""Exceptions raised by megatron-ext. Each message names the problem and the fix."""


class MegatronExtError(Exception):
    """Base class of every error megatron-ext raises on purpose."""


class MegatronCoreNotFoundError(MegatronExtError):
    """megatron-core cannot be imported, so there is nothing to patch."""


class UnsupportedReleaseError(MegatronExtError):
    """The importable megatron-core is a release megatron-ext was not written for.

    Raised by ``apply()`` and ``status()`` (unless forced) and by every ``megatron-ext`` command
    that runs megatron-core (exit 2); the message names both releases.

    Attributes:
        installed: the release found, e.g. ``"0.16.1"``.
        supported: the releases megatron-ext supports (``megatron_ext.mcore.SUPPORTED_RELEASES``).
    """

    def __init__(self, installed: str, supported: tuple, fix: str = "") -> None:
        self.installed, self.supported = installed, tuple(supported)
        super().__init__(f"megatron-core {installed} is not a supported release (supported: {', '.join(supported)}); "
                         f"install one of those, e.g. `pip install --no-deps megatron-core=={supported[-1]}`{fix}")


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


class RevertBlockedError(MegatronExtError, RuntimeError):
    """``revert()`` cannot restore a patched function: foreign code wrapped megatron-ext's wrapper
    (or replaced it) after ``apply()``; the message names it. Nothing is reverted. Also a
    ``RuntimeError``, as it was before it had its own class."""
