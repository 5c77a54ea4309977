"""Run megatron-core's Mamba layers (hybrid models) on the CPU, with megatron's own Triton kernels.

megatron-core's ``MambaMixer`` (``megatron.core.ssm.mamba_mixer``) runs dynamic-batching
inference through Triton kernels: megatron's own varlen chunk scan
(``megatron.core.ssm.ops``), ``causal_conv1d``'s varlen conv-state kernel and ``mamba_ssm``'s gated
RMSNorm. Under Triton's interpreter (``TRITON_INTERPRET=1``, set before ``triton`` is first
imported) those kernels run on CPU tensors with their real chunk grid and dtype handling; with
``MAMBA_DETERMINISTIC=1`` their reductions have a fixed order. :func:`mamba_on_cpu` supplies the
rest:

* **Compiled extension modules.** ``mamba_ssm`` (2.3.2.post1) and ``causal_conv1d`` (1.7.0),
  built from source with their CUDA builds skipped, import ``selective_scan_cuda`` /
  ``causal_conv1d_cuda`` at package import time, so ``mamba_mixer``'s ``try: import`` falls back
  to "no mamba_ssm" (``RMSNormGated`` a ``MagicMock``). Stand-in modules under those names let the
  packages import; every function they offer raises :class:`CompiledKernelUnavailable` when
  called. The dynamic-inference path never calls them (it uses the Triton kernels); the stand-ins
  are there so a call would fail loudly instead of silently running something else.
* **Import order.** ``mamba_mixer`` binds ``mamba_ssm``'s kernels and gated RMSNorm at import
  time (``try: import``); imported before the stand-ins exist it falls back for good (its
  ``ExtendedRMSNorm`` subclasses a ``MagicMock``), so :func:`mamba_on_cpu` refuses to run then.
  megatron-core's dynamic context, engine, attention and GPT modules do not import it; a runtime
  patch on the mixer (``mamba-conv-carry``) does, through :func:`megatron_ext.mcore.import_module`,
  which this module tells to import it with the stand-ins (:func:`extension_standins`): import
  the CPU backend before applying the patches.
* **CUDA-asserting helpers** (they ``assert tensor.is_cuda`` before launching a Triton kernel),
  replaced by plain-torch copies under the names ``mamba_mixer`` looked them up as:
  ``tensor_masked_update`` (every release with dynamic Mamba inference) and, from 0.19,
  ``scatter_intermediate_ssm`` / ``scatter_intermediate_conv`` (Mamba state snapshots for prefix
  caching). All three only move values (gather + scatter, no arithmetic), so the stand-ins give
  the same bits the kernels would.

* **Triton's interpreter under NumPy 2.5**: it converts one-element scalar arrays with
  ``int(array)``, which NumPy 2.5 refuses; its ``_patch_lang_tensor`` is wrapped so
  ``tl.tensor.__index__`` reads the element instead (:func:`_scalar_index`).

Everything replaced is put back when the ``with`` block exits (the stand-in extension modules
are removed from ``sys.modules`` again; packages imported meanwhile keep their references).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from typing import Any, Iterator, Optional

import torch

from .. import mcore
from ._swap import AttributeSwap

#: megatron-core's Mamba mixer module (all releases 0.17-0.19).
MAMBA_MIXER_MODULE = "megatron.core.ssm.mamba_mixer"

#: Compiled CUDA extension modules that ``mamba_ssm`` / ``causal_conv1d`` import unconditionally.
COMPILED_EXTENSIONS = ("selective_scan_cuda", "causal_conv1d_cuda")

#: Environment megatron's Mamba Triton kernels need on a CPU (read when Triton is first imported,
#: resp. when megatron-core's / mamba_ssm's ``determinism`` modules are imported).
TRITON_CPU_ENV = {"TRITON_INTERPRET": "1", "MAMBA_DETERMINISTIC": "1"}


class CompiledKernelUnavailable(NotImplementedError):
    """A compiled Mamba CUDA extension function was called on the CPU backend."""


def _causal_conv1d_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       seq_idx: Optional[torch.Tensor], initial_states: Optional[torch.Tensor], out: torch.Tensor,
                       final_states_out: Optional[torch.Tensor], silu_activation: bool) -> None:
    """Plain-torch ``causal_conv1d_cuda.causal_conv1d_fwd`` (causal-conv1d 1.7.0's signature), the
    depthwise causal convolution of the Mamba mixer's *training* forward
    (``mamba_split_conv1d_scan_combined``; dynamic inference uses the Triton varlen kernel instead).

    Args:
        x: ``(batch, dim, seqlen)`` input; weight: ``(dim, width)``; bias: ``(dim,)`` or None.
        out: ``(batch, dim, seqlen)``, written: ``conv(x)[..., t]`` over ``x[..., t - width + 1 : t + 1]``
            (zeros before the start), plus bias, then SiLU if ``silu_activation``; in ``x``'s dtype.

    Raises:
        CompiledKernelUnavailable: packed sequences (``seq_idx``), initial or final states (not
            used by a training forward of right-padded batches).
    """
    if seq_idx is not None or initial_states is not None or final_states_out is not None:
        raise CompiledKernelUnavailable("causal_conv1d_cuda.causal_conv1d_fwd with seq_idx or conv states is not "
                                        "available on the CPU backend (only a plain batch's training forward is)")
    width = weight.shape[-1]
    y = torch.nn.functional.conv1d(x.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(),
                                   padding=width - 1, groups=x.shape[1])[..., : x.shape[-1]].contiguous()
    out.copy_(torch.nn.functional.silu(y) if silu_activation else y)


#: Compiled-extension functions the CPU backend runs in plain torch (module -> name -> function).
EXTENSION_FUNCTIONS = {"causal_conv1d_cuda": {"causal_conv1d_fwd": _causal_conv1d_fwd}}


class _CompiledExtensionStandIn(types.ModuleType):
    """Module object standing in for a compiled CUDA extension: a function of
    :data:`EXTENSION_FUNCTIONS`, or any other attribute a function that raises
    :class:`CompiledKernelUnavailable` naming the module and attribute."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        module = self.__name__
        if name in EXTENSION_FUNCTIONS.get(module, {}):
            return EXTENSION_FUNCTIONS[module][name]

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise CompiledKernelUnavailable(
                f"{module}.{name}: the compiled CUDA extension is not available on the CPU backend "
                "(megatron-core's dynamic Mamba inference uses the Triton kernels; this call came "
                "from another path)")

        unavailable.__name__ = name
        return unavailable


def triton_interpreter_ready() -> tuple[bool, str]:
    """Whether this process can run the Mamba Triton kernels on the CPU, and why not.

    Returns:
        ``(True, "")`` when ``TRITON_INTERPRET=1`` and ``MAMBA_DETERMINISTIC=1`` are set and
        ``triton`` was either not imported yet or imported under them; otherwise ``(False,
        reason)`` (Triton reads ``TRITON_INTERPRET`` when its ``jit`` decorators run, at import).
    """
    missing = [f"{k}={v}" for k, v in TRITON_CPU_ENV.items() if os.environ.get(k) != v]
    if missing:
        return False, ("megatron's Mamba kernels run on the CPU only under Triton's interpreter: set "
                       + " ".join(missing) + " before Python starts")
    return True, ""


def _masked_update(states: torch.Tensor, idx: torch.Tensor, new_states: torch.Tensor) -> None:
    """Plain-torch ``tensor_masked_update``: ``states[idx[i]] = new_states[i]`` where ``idx[i] >= 0``.

    Stands in for ``megatron.core.inference.contexts.attention_context.triton.tensor_ops.
    tensor_masked_update`` (a Triton kernel behind ``assert states.is_cuda``), as ``mamba_mixer``
    imports it, to write the final conv / SSM state of each request of a step into the context's
    per-request state buffers.

    Args:
        states: ``(N, ...)`` destination (2-4 dims), e.g. ``(max_requests, conv_dim, d_conv)``
            conv states or ``(max_requests, nheads, headdim, d_state)`` SSM states; any dtype.
        idx: ``(B,)`` integer slot per source row; ``-1`` rows are skipped (padding).
        new_states: ``(B, *states.shape[1:])`` source rows; cast to ``states.dtype`` like the
            kernel's store does.
    """
    assert idx.ndim == 1
    assert states.shape[1:] == new_states.shape[1:], "State dimensions must match"
    keep = idx >= 0
    states[idx[keep].long()] = new_states[keep].to(states.dtype)


def _scatter_ssm(states: torch.Tensor, chunk_indices: torch.Tensor, real_count: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Plain-torch ``scatter_intermediate_ssm`` (0.19+): ``out[i] = states[chunk_indices[i]]``
    for ``i < real_count``; slots from ``real_count`` on are left untouched.

    Stands in for ``megatron.core.ssm.ops.intermediate_extraction.scatter_intermediate_ssm``
    (a Triton kernel behind ``assert states.is_cuda``), which copies the SSM state at the end of
    selected scan chunks (block boundaries) into the prefix-cache scratch buffer.

    Args:
        states: ``(num_chunks, nheads, headdim, d_state)`` chunk-scan states of one layer
            (``state_dtype``, fp32 unless configured otherwise).
        chunk_indices: ``(max_count,)`` int64 chunk index per scratch slot.
        real_count: ``int32[1]``, how many slots are meaningful this step.
        out: ``(max_count, nheads, headdim, d_state)`` scratch slice of one layer.
    """
    assert out.shape[1:] == states.shape[1:], "per-slot shape mismatch"
    count = min(int(real_count.reshape(-1)[0]), int(chunk_indices.numel()))
    if count <= 0:
        return
    out[:count] = states[chunk_indices[:count].long()].to(out.dtype)


def _scatter_conv(src: torch.Tensor, abs_positions: torch.Tensor, real_count: torch.Tensor,
                  out: torch.Tensor, d_conv: int) -> None:
    """Plain-torch ``scatter_intermediate_conv`` (0.19+): for slot ``i < real_count``,
    ``out[i, :, j] = src[0, clamp(abs_positions[i] - d_conv + j, 0, seq_len - 1), :]``.

    Stands in for ``megatron.core.ssm.ops.intermediate_extraction.scatter_intermediate_conv``
    (a Triton kernel behind ``assert src.is_cuda``), which copies the conv window that ends at a
    block boundary (the conv state a later request restores) into the prefix-cache scratch.

    Args:
        src: ``(1, seq_len, conv_dim)`` pre-convolution ``xBC`` of the step.
        abs_positions: ``(max_count,)`` int32 window end (exclusive) per slot.
        real_count: ``int32[1]``, how many slots are meaningful this step.
        out: ``(max_count, conv_dim, d_conv)`` scratch slice of one layer (transposed layout).
        d_conv: conv window length.
    """
    assert src.dim() == 3 and src.shape[0] == 1, f"expected src (1, seq_len, conv_dim), got {tuple(src.shape)}"
    assert out.dim() == 3 and out.shape[2] == d_conv
    count = min(int(real_count.reshape(-1)[0]), int(abs_positions.numel()))
    if count <= 0:
        return
    seq_len = src.shape[1]
    offsets = torch.arange(d_conv, device=abs_positions.device, dtype=torch.int64) - d_conv
    positions = (abs_positions[:count].to(torch.int64)[:, None] + offsets).clamp(0, seq_len - 1)
    windows = src[0][positions]  # (count, d_conv, conv_dim)
    out[:count] = windows.transpose(1, 2).to(out.dtype)


#: Triton's interpreter module; :func:`_patch_lang_tensor` there gives ``tl.tensor`` its Python
#: protocols for each interpreted kernel launch.
TRITON_INTERPRETER_MODULE = "triton.runtime.interpreter"


def _scalar_index(self: Any) -> int:
    """``tl.tensor.__index__`` under the interpreter: the integer of a one-element tensor.

    The interpreter keeps scalars (``tl.program_id``, a ``tl.load`` of one element) as
    one-element, one-dimensional NumPy arrays and converts them with ``int(array)``; NumPy 2.5
    refuses that for arrays with ``ndim > 0`` (deprecated since 1.25), so a kernel loop such as
    ``for k in range(0, chunk_size_limit, BLOCK_SIZE_K)`` in megatron's chunk-state kernel fails
    with "only 0-dimensional arrays can be converted to Python scalars". Same value, read with
    ``.item()``; a tensor of several elements still raises ``TypeError``.
    """
    data = self.handle.data
    if getattr(data, "size", 1) != 1:
        raise TypeError(f"only one-element tensors can be used as an index, got shape {data.shape}")
    return int(data.reshape(-1)[0]) if hasattr(data, "reshape") else int(data)


def _wrap_patch_lang_tensor(original: Any) -> Any:
    """Wrap Triton's ``interpreter._patch_lang_tensor`` so that, after it sets ``tl.tensor``'s
    protocols, ``__index__`` is :func:`_scalar_index`."""

    def patch_lang_tensor(tensor: Any) -> None:
        original(tensor)
        tensor.__index__ = _scalar_index

    patch_lang_tensor.__wrapped__ = original
    return patch_lang_tensor


#: ``mamba_mixer`` global -> stand-in, for the CUDA-asserting helpers it imported by name
#: (the 0.19 scatter helpers are set only where the module has them).
HELPER_STANDINS = {
    "tensor_masked_update": _masked_update,
    "scatter_intermediate_ssm": _scatter_ssm,
    "scatter_intermediate_conv": _scatter_conv,
}


def _install_extension_standins(swap: list[str]) -> None:
    """Put stand-ins for the compiled extensions into ``sys.modules`` where the real ones do not
    import; record the names added in ``swap``."""
    for name in COMPILED_EXTENSIONS:
        if name in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            sys.modules[name] = _CompiledExtensionStandIn(name)
            swap.append(name)


def _check_mamba_packages() -> None:
    """Import what ``mamba_mixer``'s optional imports need (with the extension stand-ins in place).

    Raises:
        ImportError: ``mamba_ssm`` or ``causal_conv1d`` is not installed (the message says how).
    """
    try:
        importlib.import_module("causal_conv1d.causal_conv1d_varlen")
        importlib.import_module("mamba_ssm.ops.triton.layernorm_gated")
        importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ImportError as error:
        raise ImportError(
            f"hybrid (Mamba) models on the CPU backend need mamba-ssm and causal-conv1d ({error}); "
            "run scripts/bootstrap.sh, which installs them from source without CUDA") from error


@contextlib.contextmanager
def extension_standins() -> Iterator[None]:
    """Within the block, the compiled-extension stand-ins are in ``sys.modules`` where the real
    modules do not import; removed again on exit (packages imported meanwhile keep them).

    Registered for the Mamba mixer's first import through :func:`megatron_ext.mcore.import_module`
    (below), so that a runtime patch importing the mixer before any hybrid model is built binds its
    optional ``mamba_ssm`` / ``causal_conv1d`` imports where those packages are installed without
    their CUDA builds; :func:`mamba_on_cpu` can then still run it. Where the real extensions
    import, nothing is added.
    """
    added: list[str] = []
    try:
        _install_extension_standins(added)
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


# Importing the CPU backend decides how the mixer is imported by megatron-ext (a patch's plan()).
mcore.register_import_context(MAMBA_MIXER_MODULE, extension_standins)


@contextlib.contextmanager
def mamba_on_cpu() -> Iterator[None]:
    """Within the block megatron-core's ``MambaMixer`` runs dynamic inference on CPU tensors.

    Installs the compiled-extension stand-ins, imports ``megatron.core.ssm.mamba_mixer``, binds its
    optional imports if its own import had fallen back, and replaces its CUDA-asserting helpers
    (see the module docstring). Restores all of it on exit, also when the block raises.

    Raises:
        ImportError: ``mamba_ssm`` / ``causal_conv1d`` are not installed.
        RuntimeError: Triton's interpreter is not on (:func:`triton_interpreter_ready`).
        megatron_ext.errors.MegatronCoreNotFoundError: megatron-core is not importable.
    """
    ready, why = triton_interpreter_ready()
    if not ready:
        raise RuntimeError(why)
    swap = AttributeSwap()
    with extension_standins():
        try:
            _check_mamba_packages()
            already = sys.modules.get(MAMBA_MIXER_MODULE)
            if already is not None and not getattr(already, "HAVE_MAMBA_SSM", False):
                raise RuntimeError(
                    f"{MAMBA_MIXER_MODULE} was imported before mamba_on_cpu() (without mamba_ssm: its "
                    "gated RMSNorm is a MagicMock); import megatron_ext.cpu_backend before importing "
                    "megatron-core's Mamba / hybrid model modules or applying megatron-ext's patches")
            mixer = mcore.import_module(MAMBA_MIXER_MODULE)
            for name, standin in HELPER_STANDINS.items():
                if hasattr(mixer, name):
                    swap.set(mixer, name, standin)
            interpreter = importlib.import_module(TRITON_INTERPRETER_MODULE)
            swap.set(interpreter, "_patch_lang_tensor", _wrap_patch_lang_tensor(interpreter._patch_lang_tensor))
            yield
        finally:
            swap.restore()
