"""One wrapper of megatron-core's ``swap_model_weights`` shared by every patch that must see a swap.

``megatron.core.resharding.refit.swap_model_weights`` writes new weights through ``param.data``
(no ``_version`` bump, no hook of its own). Fault 8 (``weight-update-invalidation``) flushes the
prefix cache after it and fault H11 (``mamba-decode-a-cache``) refills the Mamba decode cache of
``-exp(A_log)``. Each installs itself as an owner of :data:`SWAP_HOOK` with a callback; the
function is wrapped while any owner is installed, and after each swap (in a ``finally``: a swap
that failed half way changed weights too) every owner's callback runs.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from ..import_hooks import when_imported

REFIT_MODULE = "megatron.core.resharding.refit"
SWAP = "swap_model_weights"


def _swap_wrapper(wrapped: Callable, _instance: Any, args: tuple, kwargs: dict):
    """``swap_model_weights(...)``, then every owner's callback (:meth:`SwapHook.after_swap`)."""
    try:
        return wrapped(*args, **kwargs)
    finally:
        SWAP_HOOK.after_swap()


class SwapHook:
    """Wraps ``swap_model_weights`` in its module and in every module that imported the name, while
    at least one owner is installed.

    Importing the refit module imports the dynamic context, which is when ``MEGATRON_EXT_AUTO``
    applies the patches: the refit module may then be half-initialized, its function not defined
    yet. It is wrapped now if it is defined, else when the module finishes importing (a
    post-import hook, or an owner's hot path calling :meth:`wrap_if_ready` while :attr:`pending`).
    """

    def __init__(self) -> None:
        #: owner name -> callback run after each swap, in installation order.
        self.owners: dict[str, Callable[[], None]] = {}
        self.original: Optional[Callable] = None
        self.wrapper: Optional[Callable] = None
        self._hooked = False
        #: Installed but not wrapped yet (the refit module was half-imported at install). A plain
        #: attribute, kept by the methods below: fault 8 reads it at every prefix match.
        self.pending = False

    @property
    def active(self) -> bool:
        return bool(self.owners)

    def install(self, owner: str, on_swap: Callable[[], None]) -> None:
        """Make ``owner``'s ``on_swap()`` run after every swap from now on (wrapping the function
        if no other owner did). Installing an owner again replaces its callback."""
        self.owners[owner] = on_swap
        self.pending = self.original is None
        module = sys.modules.get(REFIT_MODULE)
        if module is None and not self._hooked:
            # No waiting for another thread's import of the module: apply() holds its lock here,
            # which that import may need (MEGATRON_EXT_AUTO applies from an import hook). An
            # import missed that way is caught up by wrap_if_ready() (self.pending).
            when_imported(REFIT_MODULE, lambda _module: self.wrap_if_ready(), wait=False)
            self._hooked = True
        self.wrap_if_ready()

    def uninstall(self, owner: str) -> None:
        """Stop calling ``owner``'s callback; the last owner out puts the released function back."""
        self.owners.pop(owner, None)
        if self.owners:
            return
        self.pending = False
        if self.original is not None:
            # modules that imported the name after wrapping hold the wrapper too: scan, not a list
            self._rebind(self.wrapper, self.original)
        self.original = self.wrapper = None

    def wrap_if_ready(self) -> bool:
        """Wrap the function if it is defined and not wrapped yet; whether it is wrapped now."""
        if not self.active or self.original is not None:
            return self.original is not None
        function = getattr(sys.modules.get(REFIT_MODULE), SWAP, None)
        if function is None:
            return False
        import wrapt

        self.original = function
        self.wrapper = wrapt.FunctionWrapper(function, _swap_wrapper)
        self._rebind(function, self.wrapper)
        self.pending = False
        return True

    def after_swap(self) -> None:
        """Run every owner's callback; one that raises does not keep the others from running (the
        first exception is raised after all ran)."""
        error: Optional[BaseException] = None
        for on_swap in list(self.owners.values()):
            try:
                on_swap()
            except BaseException as exc:  # noqa: BLE001  re-raised below, after the others ran
                error = error or exc
        if error is not None:
            raise error

    @staticmethod
    def _rebind(old: Callable, new: Callable) -> None:
        """Every loaded module whose global ``swap_model_weights`` is ``old`` gets ``new``."""
        for module in list(sys.modules.values()):
            if getattr(module, "__dict__", {}).get(SWAP) is old:
                setattr(module, SWAP, new)


#: The one hook of the process (the patches in ALL_PATCHES install and remove themselves as owners).
SWAP_HOOK = SwapHook()
