"""Batch-invariant CPU matrix products: a row's bits do not depend on the rows beside it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.cpu_backend import batch_invariant as bi

SHAPES = [(3, 16, 8), (17, 64, 96), (40, 100, 72)]  # (M, K, N)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def mode_off_around_each_test():
    assert not bi.is_enabled(), "a previous test left the batch-invariant mode on"
    yield
    bi.disable()


def _operands(m, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return a, w, bias


OPS = {
    "mm": lambda x, w, b: torch.mm(x, w.t()),
    "addmm": lambda x, w, b: torch.addmm(b, x, w.t()),
    "addmm-scaled": lambda x, w, b: torch.addmm(b, x, w.t(), beta=0.5, alpha=2.0),
    "linear": lambda x, w, b: F.linear(x, w, b),
    "linear-3d": lambda x, w, b: F.linear(x.unsqueeze(1), w, b).squeeze(1),  # [s, b, h] as megatron
    "matmul-3d": lambda x, w, b: torch.matmul(x.unsqueeze(1), w.t()).squeeze(1),
    "bmm": lambda x, w, b: torch.bmm(torch.stack([x, 2 * x]), torch.stack([w.t(), w.t()]))[1],
    "baddbmm": lambda x, w, b: torch.baddbmm(b, torch.stack([x, x]), torch.stack([w.t()] * 2))[0],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rows_bit_identical_alone_and_in_batch(op, dtype, shape):
    a, w, bias = _operands(*shape, dtype)
    fn = OPS[op]
    with bi.batch_invariant_mode():
        full = fn(a, w, bias)
        for i in range(a.shape[0]):
            assert torch.equal(fn(a[i:i + 1], w, bias)[0], full[i]), f"row {i}"
        assert torch.equal(fn(a[2:9], w, bias), full[2:9])
    reference = fn(a.double(), w.double(), bias.double())
    tolerance = 1e-4 if dtype == torch.float32 else 0.5
    torch.testing.assert_close(full.double(), reference, rtol=tolerance, atol=tolerance)


def test_out_variants_are_row_wise():
    a, w, bias = _operands(9, 32, 16, torch.float32)
    with bi.batch_invariant_mode():
        expected = torch.mm(a, w.t())
        out = torch.empty(1)
        torch.mm(a, w.t(), out=out)
        assert torch.equal(out, expected)
        torch.addmm(bias, a, w.t(), out=out)
        assert torch.equal(out, torch.addmm(bias, a, w.t()))
        batched = torch.empty(0)
        torch.bmm(a[None], w.t()[None], out=batched)
        assert torch.equal(batched[0], expected)
        torch.baddbmm(bias, a[None], w.t()[None], out=batched)
        assert torch.equal(batched[0], torch.addmm(bias, a, w.t()))


def test_empty_and_beta_zero_edge_cases():
    with bi.batch_invariant_mode():
        assert torch.mm(torch.ones(0, 4), torch.ones(4, 3)).shape == (0, 3)
        assert torch.equal(torch.mm(torch.ones(2, 0), torch.ones(0, 3)), torch.zeros(2, 3))
        assert torch.bmm(torch.ones(0, 2, 4), torch.ones(0, 4, 3)).shape == (0, 2, 3)
        nan_bias = torch.full((3,), float("nan"))
        assert torch.equal(torch.addmm(nan_bias, torch.ones(2, 4), torch.ones(4, 3), beta=0),
                           torch.full((2, 3), 4.0))


@pytest.fixture(params=[1, None], ids=["1-thread", "default-threads"])
def intra_op_threads(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param or threads)
    yield
    torch.set_num_threads(threads)


def test_fp32_products_are_batch_variant_without_the_mode(intra_op_threads):
    """On this CPU (MKL) an fp32 row computed alone, or with one neighbour, differs from the same
    row in a larger batch, even single-threaded: this is why the mode exists. If this fails, the
    machine's BLAS happens to be invariant for these shapes."""
    a, w, _ = _operands(17, 64, 96, torch.float32)
    full = torch.mm(a, w.t())
    alone = sum(not torch.equal(torch.mm(a[i:i + 1], w.t())[0], full[i]) for i in range(17))
    paired = sum(not torch.equal(torch.mm(a[i:i + 2], w.t())[0], full[i]) for i in range(16))
    assert alone > 0 and paired > 0
    ok, detail = bi.self_check(enabled=False)
    assert not ok
    assert "mm float32" in detail and "linear float32" in detail


def test_self_check_passes_with_the_mode_and_restores_state():
    ok, detail = bi.self_check()
    assert ok, detail
    assert detail.startswith("batch-invariant with the mode on")
    assert not bi.is_enabled()
    with bi.batch_invariant_mode():
        assert bi.self_check(enabled=None)[0]
        assert not bi.self_check(enabled=False)[0]
        assert bi.is_enabled()  # restored after the enabled=False check


def test_switching_is_idempotent_nests_and_really_removes_the_overrides():
    a, w, _ = _operands(17, 64, 96, torch.float32)
    before = torch.mm(a, w.t())
    bi.enable()
    bi.enable()
    assert bi.is_enabled()
    with bi.batch_invariant_mode(False):
        assert not bi.is_enabled()
        assert torch.equal(torch.mm(a, w.t()), before)  # torch's own kernel again
        with bi.batch_invariant_mode(True):
            assert bi.is_enabled()
        assert not bi.is_enabled()
    assert bi.is_enabled()
    bi.disable()
    bi.disable()
    assert not bi.is_enabled()
    assert torch.equal(torch.mm(a, w.t()), before)


def test_mode_restored_when_block_raises():
    with pytest.raises(KeyError):
        with bi.batch_invariant_mode():
            raise KeyError("boom")
    assert not bi.is_enabled()


def test_import_does_not_enable_the_mode():
    code = ("import torch, megatron_ext.cpu_backend;"
            "from megatron_ext.cpu_backend import batch_invariant as bi;"
            "assert not bi.is_enabled();"
            "a = torch.randn(17, 64); b = torch.randn(64, 96); full = a @ b;"
            "print(sum(not torch.equal((a[i:i+1] @ b)[0], full[i]) for i in range(17)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) > 0  # torch's own (batch-variant) kernel is in use
