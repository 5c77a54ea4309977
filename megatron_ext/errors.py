"""Exceptions raised by megatron-ext. Each message names the problem and the fix."""


class MegatronExtError(Exception):
    """Base class of every error megatron-ext raises on purpose."""


class MegatronCoreNotFoundError(MegatronExtError):
    """megatron-core cannot be imported, so there is nothing to patch."""


class UnsupportedReleaseError(MegatronExtError):
    """The importable megatron-core is older than the first release with prefix caching (0.17.0):
    there is nothing to fingerprint against. Newer trees, released or not (a Megatron-LM checkout
    says "0.20.0"), are judged patch by patch by their code instead.

    Raised by ``apply()`` and ``status()`` (unless forced) and by every ``megatron-ext`` command
    that runs megatron-core (exit 2); the message names both releases.

    Attributes:
        installed: the release found, e.g. ``"0.16.1"``.
        supported: the releases megatron-ext supports (``megatron_ext.mcore.SUPPORTED_RELEASES``).
    """

    def __init__(self, installed: str, supported: tuple, fix: str = "") -> None:
        self.installed, self.supported = installed, tuple(supported)
        super().__init__(f"megatron-core {installed} is older than {supported[0]}, the first release with prefix "
                         f"caching: megatron-ext has nothing to patch there (supported: {', '.join(supported)}, and "
                         f"Megatron-LM checkouts judged by their code); install one of those, e.g. "
                         f"`pip install --no-deps megatron-core=={supported[-1]}`{fix}")


class PatchRefusedError(MegatronExtError):
    """A patch was refused: its target code is not one megatron-ext has checked, or its probe failed.

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
