"""Fault H10 (issue 33): megatron's Mamba decode kernel stores its state into ``x[0, 0, 0, 0]``.

``selective_state_update`` (``megatron/core/ssm/ops/mamba_ssm.py``, 0.17.0 to 0.19.2), called by
``MambaMixer`` for every decode step of a hybrid model, takes an optional buffer for the SSM state
after each token (speculative decoding). Without one it passes ``x`` as a dummy buffer with zero
strides, and the Triton kernel's ``HAS_INT_STATE`` heuristic only tests ``int_state_ptr is not
None``: every program (tile of channels, request, head) stores its state tile through the
zero-stride pointers, all into ``x[0, 0, 0, 0]``. ``x`` is changed by the call (it ends as the last
state element stored). Programs run in grid order under Triton's interpreter, so program
``(0, 0, 0)`` reads ``x[0, 0, 0, 0]`` before any store: nothing else shows on the CPU. On a GPU a
store that lands before that program's load corrupts request 0's head-0 / channel-0 output and SSM
state, for the rest of that request.

Megatron-LM PR #6598 (open, in no release; the fix is one deleted line) leaves the buffer
``None`` when none is given, so ``HAS_INT_STATE`` is false and the kernel stores nothing there.
This patch makes the launch do the same: the launcher looks the kernel up as a module global at
call time, and the patch puts a :class:`~megatron_ext.patching.WrappedKernel` there whose launches
pass ``None`` where the launcher passed its dummy (``x`` itself, zero strides). A real buffer is
passed on unchanged; the kernel's outputs are the same bits.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from .. import mcore
from ..patching import KernelLaunch, Patch, Target

MAMBA_SSM_MODULE = "megatron.core.ssm.ops.mamba_ssm"
KERNEL = Target(MAMBA_SSM_MODULE, "_selective_scan_update_kernel")
LAUNCHER = Target(MAMBA_SSM_MODULE, "selective_state_update")
#: Where Megatron-LM main moved the same file (d98e8a64, 2026-08-22: byte for byte 0.19.2's).
MOVED_MAMBA_SSM_MODULE = "megatron.core.ssm.ops.mamba2.mamba_ssm"
MOVED_KERNEL = Target(MOVED_MAMBA_SSM_MODULE, "_selective_scan_update_kernel")
MOVED_LAUNCHER = Target(MOVED_MAMBA_SSM_MODULE, "selective_state_update")


def _present() -> tuple[Target, Target]:
    """(kernel, launcher) where the installed tree has them: ``ops/mamba_ssm.py`` (0.17 to 0.19,
    main at 2a75ac12c5) or main's ``ops/mamba2/mamba_ssm.py``. Looks at the files, imports nothing
    (this runs from the start-up hook, inside megatron-core's own imports)."""
    package = Path((sys.modules.get("megatron.core") or mcore.import_module("megatron.core")).__file__).parent
    moved = package.joinpath(*MOVED_MAMBA_SSM_MODULE.split(".")[2:]).with_suffix(".py")
    old = package.joinpath(*MAMBA_SSM_MODULE.split(".")[2:]).with_suffix(".py")
    return (MOVED_KERNEL, MOVED_LAUNCHER) if moved.is_file() and not old.is_file() else (KERNEL, LAUNCHER)


#: Positions in ``_selective_scan_update_kernel``'s parameter list (0.17.0 to 0.19.2, fingerprinted):
#: ``x_ptr``, ``int_state_ptr`` and ``stride_int_batch`` .. ``stride_int_dstate``.
X_ARG, INT_STATE_ARG, INT_STRIDES = 1, 11, slice(53, 58)

#: The launcher's line that #6598 deletes.
DUMMY_LINE = "intermediate_ssm_states = x"


def _launch_without_dummy(launch: Callable, _instance: None, args: tuple, kwargs: dict) -> Any:
    """Launch the kernel with ``int_state_ptr = None`` where the launcher passed its dummy (``x``
    itself with zero strides), as #6598's launcher does; other launches as they are."""
    if args[INT_STATE_ARG] is args[X_ARG] and not any(args[INT_STRIDES]):
        args = (*args[:INT_STATE_ARG], None, *args[INT_STATE_ARG + 1:])
    return launch(*args, **kwargs)


def passes_dummy_buffer(launcher: Callable) -> tuple[bool, str]:
    """Whether ``selective_state_update`` passes ``x`` as the intermediate-state buffer when none is
    given. Reads its source. Returns ``(has_fault, evidence)``."""
    if DUMMY_LINE in inspect.getsource(launcher):
        return True, ("selective_state_update passes x as the intermediate-state buffer when none is given "
                      "(zero strides): every kernel program stores its state tile into x[0, 0, 0, 0]")
    return False, "selective_state_update passes no dummy intermediate-state buffer (as Megatron-LM #6598)"


class MambaDecodeNoDummyPatch(Patch):
    """Keeps megatron's Mamba decode kernel from storing into its ``x`` (see module docstring)."""

    name = "mamba-decode-no-dummy"
    fault = "H10"
    source_patched_targets = (LAUNCHER,)
    # MEGATRON_EXT_AUTO: the Mamba mixer imports the module; until then, importing it (and Triton)
    # from the dynamic context's hook would cost every GPT-only job (waits_for_import, below)

    def wrappers(self) -> dict[Target, KernelLaunch]:
        return {_present()[0]: KernelLaunch(_launch_without_dummy)}

    @property
    def waits_for_import(self) -> tuple[Target, ...]:  # type: ignore[override]
        return (_present()[0],)

    def checked_functions(self) -> tuple[Target, ...]:
        """The kernel (positions of its arguments, its ``HAS_INT_STATE`` heuristic) and its launcher,
        wherever the tree keeps them (fingerprints are keyed by name: the moved file's functions
        compare with the releases' directly)."""
        return _present()

    def needed(self) -> tuple[bool, str]:
        """Not needed on source-patched code (fingerprint), on code without the dummy
        (:func:`passes_dummy_buffer`), nor without Triton (megatron-core then has no kernel)."""
        kernel, launcher = _present()
        if launcher is LAUNCHER:  # the source patches of patches/ edit the launcher there
            needed, evidence = super().needed()
            if not needed:
                return needed, evidence
        if not getattr(mcore.import_module(launcher.module), "HAVE_TRITON", True):
            return False, f"Triton is not installed: {launcher.module} has no kernel to launch"
        return passes_dummy_buffer(launcher.original())
