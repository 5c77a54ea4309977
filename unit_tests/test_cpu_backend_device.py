"""CUDA requests served on the CPU inside ``cuda_on_cpu``, and everything put back afterwards."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.cpu_backend import device
from megatron_ext.cpu_backend.device import CUDA_STANDINS, cuda_on_cpu

CPU = torch.device("cpu")


def _torch_state():
    """The objects cuda_on_cpu replaces, and whether a torch function mode is active."""
    rng_names = ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all")
    return ({name: torch.cuda.__dict__.get(name) for name in CUDA_STANDINS},
            {name: torch.cuda.random.__dict__.get(name) for name in rng_names},
            torch.Generator, torch._C._len_torch_function_stack())


CUDA_SPECS = ["cuda", "cuda:0", 0, torch.device("cuda"), torch.device("cuda", 0)]


@pytest.mark.parametrize("spec", CUDA_SPECS, ids=repr)
def test_factories_and_moves_land_on_the_cpu(spec):
    with cuda_on_cpu():
        assert torch.zeros(3, device=spec).device == CPU
        assert torch.full((2,), 1.5, device=spec).device == CPU
        assert torch.arange(4, device=spec).device == CPU
        assert torch.tensor([1, 2], device=spec).device == CPU
        x = torch.ones(2)
        assert x.to(spec).device == CPU
        assert x.to(spec, torch.float64).dtype == torch.float64
        assert x.to(device=spec, non_blocking=True).device == CPU
        assert x.new_zeros(3, device=spec).device == CPU
        assert torch.empty_like(x, device=spec).device == CPU


def test_pinning_and_cuda_calls_are_no_ops():
    with cuda_on_cpu():
        x = torch.ones(3)
        assert x.cuda() is x and x.cuda(0) is x
        assert x.pin_memory() is x
        assert not torch.empty(4, pin_memory=True).is_pinned()
        assert not torch.empty_like(x, pin_memory=True).is_pinned()
        x.record_stream(torch.cuda.current_stream())
        assert x.to(torch.float16).dtype == torch.float16  # dtype-only .to() untouched
        assert x.to(x).dtype == x.dtype


def test_cuda_module_standins():
    with cuda_on_cpu():
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.current_device() == 0
        free, total = torch.cuda.mem_get_info()
        assert 0 < free <= total
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record(torch.cuda.current_stream())
        end.synchronize()
        assert end.query() and start.elapsed_time(end) >= 0.0
        stream = torch.cuda.Stream(device=0)
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
            stream.wait_event(start)
        generator = torch.Generator(device=torch.cuda.current_device())
        assert generator.device == CPU and isinstance(generator, torch._C.Generator)
        assert torch.randn(2, generator=generator.manual_seed(3)).shape == (2,)


def test_cuda_rng_state_standins_do_not_recurse_into_torch_manual_seed():
    with cuda_on_cpu():
        torch.manual_seed(7)  # calls torch.cuda.manual_seed_all now that CUDA is "available"
        first = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(7)
        assert torch.equal(torch.cuda.random.get_rng_state(), first)
        torch.cuda.manual_seed(8)
        assert not torch.equal(torch.cuda.get_rng_state(), first)
        torch.cuda.set_rng_state(first)
        assert torch.equal(torch.cuda.get_rng_state(), first)
        assert torch.cuda.initial_seed() == 7
    cpu_draw = torch.manual_seed(7) and torch.rand(3)
    assert torch.equal(cpu_draw, torch.manual_seed(7) and torch.rand(3))


def test_seed_argument_seeds_the_cuda_rng_standin():
    with cuda_on_cpu(seed=11):
        state = torch.cuda.get_rng_state()
    with cuda_on_cpu(seed=11):
        assert torch.equal(torch.cuda.get_rng_state(), state)


def test_everything_restored_on_exit_and_on_error():
    before = _torch_state()
    available = torch.cuda.is_available()
    with cuda_on_cpu():
        assert _torch_state() != before
    assert _torch_state() == before
    with pytest.raises(ZeroDivisionError):
        with cuda_on_cpu():
            1 / 0
    assert _torch_state() == before
    assert torch.cuda.is_available() == available
    assert torch.Generator is torch._C.Generator


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_requests_fail_again_after_exit():
    with cuda_on_cpu():
        torch.zeros(1, device="cuda")
    assert torch.cuda.is_available() is False
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_queued_cuda_calls_made_inside_are_dropped():
    queued = device._queued_cuda_calls()
    before = len(queued)
    with cuda_on_cpu():
        torch.cuda._lazy_call(lambda: None)  # what megatron-core's _set_cuda_rng_state does
    assert len(queued) == before


def test_refuses_when_cuda_is_initialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialized"):
        with cuda_on_cpu():
            pass


def test_map_device():
    assert device.map_device("cuda:1") == CPU
    assert device.map_device(3) == CPU
    assert device.map_device("cpu") == "cpu"
    assert device.map_device("meta") == "meta"
    assert device.map_device(True) is True
    assert device.map_device(None) is None
