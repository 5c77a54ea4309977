"""The environment a hybrid (Mamba) case needs on the CPU backend: ``TRITON_INTERPRET=1
MAMBA_DETERMINISTIC=1`` (:data:`megatron_ext.cpu_backend.mamba.TRITON_CPU_ENV`), read by Triton
and the Mamba kernel modules when they are imported. ``ab``, ``soak`` and ``save-checkpoint`` set
them themselves (:func:`ensure_hybrid_cpu_environment`), re-executing the program once when a
reader is imported already."""

from __future__ import annotations

import os
import sys
from typing import Any

from ..errors import MegatronExtError

#: Set in the environment of the process :func:`ensure_hybrid_cpu_environment` re-executes (against a loop).
TRITON_REEXEC_ENV = "MEGATRON_EXT_TRITON_REEXEC"

#: Modules that read ``TRITON_INTERPRET`` / ``MAMBA_DETERMINISTIC`` when they are imported.
_TRITON_ENV_READERS = ("triton", "mamba_ssm", "megatron.core.ssm")


class TritonEnvironmentError(MegatronExtError):
    """A hybrid case on the CPU lacks Triton's variables and this process cannot set them any more."""


def ensure_hybrid_cpu_environment(case: Any, device: str, program: bool) -> None:
    """A hybrid case on the CPU backend needs ``TRITON_INTERPRET=1 MAMBA_DETERMINISTIC=1``
    before Triton and the Mamba kernel modules are imported; the command sets them itself. Nothing
    of the kind is imported yet (the usual case: the command has only read its case): set here,
    for this process. Otherwise, when this process is the ``megatron-ext`` program (``program``),
    it re-executes itself once with them (``os.execv``; the marker ``MEGATRON_EXT_TRITON_REEXEC``
    stops a loop). A command called in-process (``main(argv)``) never changes the environment:
    its caller must set them.

    Args:
        case: the run's :class:`~megatron_ext.harness.cases.Case`; a GPT case needs nothing unless
            it decodes speculatively (megatron-core's Triton MTP kernels).
        device: ``"cpu"`` or ``"cuda"``; CUDA needs nothing.
        program: this process is the ``megatron-ext`` program (it may re-execute itself).

    Raises:
        TritonEnvironmentError: they are missing, Triton is already imported and this process
            cannot re-execute itself (already re-executed once).
    """
    if not (case.model.is_hybrid or case.inference.num_speculative_tokens) or device != "cpu":
        return  # GPT cases without speculative decoding run no Triton kernel on the CPU
    from ..cpu_backend.mamba import TRITON_CPU_ENV

    missing = {k: v for k, v in TRITON_CPU_ENV.items() if os.environ.get(k) != v}
    if not missing or not program:
        return  # in-process: mamba_on_cpu refuses with the variables named
    if not triton_env_read():
        os.environ.update(missing)
        return
    if os.environ.get(TRITON_REEXEC_ENV) != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os.environ.update({**missing, TRITON_REEXEC_ENV: "1"})
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    raise TritonEnvironmentError(f"{'hybrid' if case.model.is_hybrid else 'speculative-decoding'} case on the CPU: Triton was imported before megatron-ext could set "
                                 + " ".join(f"{k}={v}" for k, v in missing.items())
                                 + "; set them in the environment before Python starts")


def triton_env_read() -> bool:
    """Whether a module that reads the Triton / Mamba variables at import is imported already."""
    return any(name == reader or name.startswith(reader + ".")
               for name in list(sys.modules) for reader in _TRITON_ENV_READERS)
