"""Batch-invariant matrix products on the CPU.

On this kind of CPU, fp32 ``F.linear`` / ``torch.mm`` is batch-variant even single-threaded: a
row of ``A @ B`` computed alone (``M = 1``, a matrix-vector kernel) differs in the low bits from
the same row computed in a larger batch (a blocked GEMM kernel). The dynamic inference engine
batches different rows when prefix caching is on or off, so without this mode a caching on/off
comparison can differ for reasons that have nothing to do with caching.

While enabled, ``torch.library`` overrides on the ``CPU`` dispatch key replace ``aten::mm``,
``aten::addmm``, ``aten::bmm`` and ``aten::baddbmm`` (and their ``out=`` overloads): every
output row is a separate matrix-vector product (``torch.mv`` / ``torch.addmv``, which are not
overridden) of a freshly allocated copy of the input row against the same right-hand matrix. A
row's bits then depend only on its own data, never on how many rows share the call.
``F.linear`` and ``torch.matmul`` reach these ops when they decompose, so they are covered.

The overrides are process-wide (the dispatcher is global: every thread sees them) and exist only
between :func:`enable` and :func:`disable`, or inside :func:`batch_invariant_mode`. A process
that never asks for them never has them. :func:`self_check` shows, on the running machine, that
the mode gives bit-identical rows; a bit-identity claim should be refused if it fails.

Cost: one small kernel per output row. With more than one intra-op thread on a busy machine each
of those can wait milliseconds for a core (seen with bf16 ``mv`` on 2 cores), so runs that only
need correctness are much faster after ``torch.set_num_threads(1)``. A row's bits may depend on
the thread count, so compare runs made with the same count.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator, Optional

import torch

_LIBRARY: Optional[torch.library.Library] = None


# --- row-wise kernels ------------------------------------------------------------------------

def _row_products(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
                  beta: float, alpha: float) -> torch.Tensor:
    """``beta * bias + alpha * (a @ b)`` one output row at a time.

    ``a`` ``[M, K]``, ``b`` ``[K, N]``, ``bias`` broadcastable to ``[M, N]`` or None; returns
    ``[M, N]`` in the dtype ``mm`` would return.
    """
    rows, cols = a.shape[0], b.shape[1]
    out = torch.empty(rows, cols, dtype=torch.result_type(a, b), device=a.device)
    b_t = b.t()  # [N, K]: each row is mv(b^T, a_row)
    bias_rows = None if bias is None else bias.expand(rows, cols)
    for i in range(rows):
        # A fresh copy puts every row at the same (allocator-aligned) address, so a BLAS kernel
        # with alignment-dependent paths still sees the same input for the same row.
        row = a[i].clone()
        if bias_rows is None:
            out[i] = torch.mv(b_t, row) if alpha == 1 else torch.mv(b_t, row) * alpha
        else:
            out[i] = torch.addmv(bias_rows[i], b_t, row, beta=beta, alpha=alpha)
    return out


def _mm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    return _row_products(self, mat2, None, 0, 1)


def _addmm(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta=1, alpha=1):
    if beta == 0:  # addmm ignores the input entirely (even NaN) when beta is 0
        return _row_products(mat1, mat2, None, 0, alpha)
    return _row_products(mat1, mat2, self, beta, alpha)


def _bmm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    if self.shape[0] == 0:
        return torch.empty(0, self.shape[1], mat2.shape[2], dtype=self.dtype, device=self.device)
    return torch.stack([_row_products(self[i], mat2[i], None, 0, 1) for i in range(self.shape[0])])


def _baddbmm(self: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta=1, alpha=1):
    if beta == 0:
        return _bmm(batch1, batch2) * alpha if alpha != 1 else _bmm(batch1, batch2)
    size = (batch1.shape[0], batch1.shape[1], batch2.shape[2])
    if size[0] == 0:
        return torch.empty(size, dtype=batch1.dtype, device=batch1.device)
    bias = self.expand(size)
    return torch.stack([_row_products(batch1[i], batch2[i], bias[i], beta, alpha)
                        for i in range(size[0])])


def _into(out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    out.resize_(result.shape)
    return out.copy_(result)


def _mm_out(self, mat2, *, out):
    return _into(out, _mm(self, mat2))


def _addmm_out(self, mat1, mat2, *, beta=1, alpha=1, out):
    return _into(out, _addmm(self, mat1, mat2, beta=beta, alpha=alpha))


def _bmm_out(self, mat2, *, out):
    return _into(out, _bmm(self, mat2))


def _baddbmm_out(self, batch1, batch2, *, beta=1, alpha=1, out):
    return _into(out, _baddbmm(self, batch1, batch2, beta=beta, alpha=alpha))


#: aten operator (overload) -> row-wise CPU kernel installed while the mode is on.
OVERRIDES: dict[str, Callable] = {
    "mm": _mm,
    "mm.out": _mm_out,
    "addmm": _addmm,
    "addmm.out": _addmm_out,
    "bmm": _bmm,
    "bmm.out": _bmm_out,
    "baddbmm": _baddbmm,
    "baddbmm.out": _baddbmm_out,
}


# --- switching -------------------------------------------------------------------------------

def is_enabled() -> bool:
    """True while the batch-invariant CPU overrides are registered in this process."""
    return _LIBRARY is not None


def enable() -> None:
    """Register the row-wise overrides of :data:`OVERRIDES` on the ``CPU`` dispatch key.

    Idempotent. Affects every thread of the process until :func:`disable`.
    """
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns that a built-in kernel is being overridden: that is the point.
        warnings.simplefilter("ignore")
        for op, kernel in OVERRIDES.items():
            library.impl(op, kernel, "CPU")
    _LIBRARY = library


def disable() -> None:
    """Remove the overrides; torch's own CPU kernels are in use again. Idempotent."""
    global _LIBRARY
    if _LIBRARY is None:
        return
    library, _LIBRARY = _LIBRARY, None
    library._destroy()


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Turn the overrides on (or, with ``enabled=False``, off) for the block.

    The state on entry is restored on exit, so blocks nest in either direction.
    """
    previous = is_enabled()
    (enable if enabled else disable)()
    try:
        yield
    finally:
        (enable if previous else disable)()


# --- self check --------------------------------------------------------------------------------

#: (M, K, N) shapes the self check multiplies; they cover M above and below typical blocking
#: sizes, K and N that are and are not multiples of the vector width.
CHECK_SHAPES: tuple[tuple[int, int, int], ...] = ((2, 16, 8), (5, 64, 96), (17, 64, 192),
                                                  (33, 200, 64), (24, 128, 256))
CHECK_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


def _check_cases(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> dict[str, Callable]:
    """Name -> function of the row-selected left operand; each returns rows in the same order."""
    b = w.t()  # [K, N], as F.linear passes it
    return {
        "mm": lambda x: torch.mm(x, b),
        "addmm": lambda x: torch.addmm(bias, x, b),
        "linear": lambda x: torch.nn.functional.linear(x, w, bias),
        "linear-3d": lambda x: torch.nn.functional.linear(x.unsqueeze(1), w, bias).squeeze(1),
        "matmul": lambda x: torch.matmul(x, b),
        # Batch of two identical problems: checks the batched products row-wise.
        "bmm": lambda x: torch.bmm(torch.stack([x, x]), torch.stack([b, b]))[1],
        "baddbmm": lambda x: torch.baddbmm(bias, torch.stack([x, x]), torch.stack([b, b]))[1],
    }


def _rowwise_cases(weight: torch.Tensor) -> dict[str, Callable]:
    """Row-wise ops the model also runs; not overridden, checked so a failure is reported."""
    n = weight.shape[0]
    return {
        "layer_norm": lambda x: torch.nn.functional.layer_norm(x, (n,), weight, weight),
        "rms_norm": lambda x: torch.nn.functional.rms_norm(x, (n,), weight),
        "softmax": lambda x: torch.softmax(x, dim=-1),
        "log_softmax": lambda x: torch.log_softmax(x.float(), dim=-1),
    }


def _row_mismatches(fn: Callable, x: torch.Tensor) -> int:
    """How many rows of ``fn(x)`` differ (bitwise) from the same rows computed alone or in a
    middle slice."""
    full = fn(x)
    rows = x.shape[0]
    bad = sum(not torch.equal(fn(x[i:i + 1])[0], full[i]) for i in range(rows))
    lo, hi = rows // 3, max(rows // 3 + 1, (2 * rows) // 3)
    bad += int(not torch.equal(fn(x[lo:hi]), full[lo:hi]))
    return bad


def self_check(enabled: Optional[bool] = True, seed: int = 1234) -> tuple[bool, str]:
    """Show on this machine that matrix products give the same bits for a row alone and in a batch.

    For fp32 and bf16 random matrices of the shapes in :data:`CHECK_SHAPES`, every row of
    ``mm``, ``addmm``, ``F.linear`` (2-D and 3-D input), ``matmul``, ``bmm`` and ``baddbmm`` is
    compared bit for bit between the full product (``M`` rows), the row alone (``M = 1``) and a
    middle slice. Row-wise ops the model also uses (``layer_norm``, ``rms_norm``, ``softmax``,
    ``log_softmax``; not overridden) are checked the same way.

    Args:
        enabled: run the check with the mode on (True), off (False), or as it is now (None).
            The mode's state is restored afterwards.
        seed: seed of a private generator for the random matrices (the global RNG is untouched).

    Returns:
        ``(ok, detail)``: ``ok`` is True iff every comparison is bit-identical; ``detail`` is one
        line per failing case (``op dtype MxKxN: r rows differ``), or a one-line summary.
    """
    generator = torch.Generator().manual_seed(seed)
    failures, checked = [], 0
    mode = contextlib.nullcontext() if enabled is None else batch_invariant_mode(enabled)
    with mode, torch.inference_mode():
        for dtype in CHECK_DTYPES:
            for m, k, n in CHECK_SHAPES:
                a = torch.randn(m, k, generator=generator).to(dtype)
                w = torch.randn(n, k, generator=generator).to(dtype)
                bias = torch.randn(n, generator=generator).to(dtype)
                cases = _check_cases(a, w, bias)
                cases.update(_rowwise_cases(torch.randn(k, generator=generator).to(dtype)))
                for name, fn in cases.items():
                    bad = _row_mismatches(fn, a)
                    checked += 1
                    if bad:
                        failures.append(f"{name} {str(dtype).removeprefix('torch.')} "
                                        f"{m}x{k}x{n}: {bad} of {m + 1} comparisons differ")
    state = {True: "on", False: "off", None: "on" if is_enabled() else "off"}[enabled]
    if failures:
        return False, (f"batch-variant with the mode {state}: {len(failures)} of {checked} "
                       "cases differ\n" + "\n".join(failures))
    return True, f"batch-invariant with the mode {state}: {checked} cases bit-identical"
