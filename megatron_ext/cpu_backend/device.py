"""Serve megatron-core's CUDA device, stream, event, RNG and pinned-memory requests on the CPU.

megatron-core's dynamic inference stack asks for ``device=torch.cuda.current_device()``,
``pin_memory=True``, CUDA events and streams, the CUDA RNG state, and a CUDA ``torch.Generator``.
:func:`cuda_on_cpu` answers all of them on the CPU for the duration of a ``with`` block:

* a :class:`torch.overrides.TorchFunctionMode` rewrites CUDA devices (``"cuda"``, ``"cuda:0"``,
  ``torch.device("cuda")``, a bare device index) to ``"cpu"`` in every torch call, drops
  ``pin_memory=True`` and turns ``Tensor.cuda()`` / ``Tensor.pin_memory()`` /
  ``Tensor.record_stream()`` into no-ops;
* the ``torch.cuda`` functions the engine calls are replaced by CPU stand-ins (see
  :data:`CUDA_STANDINS`), ``torch.Generator`` by a subclass that builds CPU generators.

Everything is put back exactly on exit. The mode is thread-local (torch function modes are), so
only the thread that entered the block sees CPU devices.
"""

from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ._swap import AttributeSwap

CPU = torch.device("cpu")


def map_device(device: Any) -> Any:
    """Return ``"cpu"``'s device for a CUDA device spec, anything else unchanged.

    Args:
        device: a ``str`` (``"cuda"``, ``"cuda:1"``), a ``torch.device``, or an ``int`` device
            index (which torch reads as a CUDA device); ``bool`` is not a device index.

    Returns:
        ``torch.device("cpu")`` for a CUDA spec, otherwise ``device`` itself.
    """
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return CPU
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


def _is_device_spec(value: Any) -> bool:
    # Tensor.to(x): x may be a device, a dtype, or another tensor; only the first kind is mapped.
    return isinstance(value, (str, torch.device)) or (
        isinstance(value, int) and not isinstance(value, bool)
    )


def _tensor_to(func: Callable, args: tuple, kwargs: dict) -> Any:
    args = list(args)
    if len(args) > 1 and _is_device_spec(args[1]):
        args[1] = map_device(args[1])
    if "device" in kwargs:
        kwargs["device"] = map_device(kwargs["device"])
    return func(*args, **kwargs)


def _return_self(func: Callable, args: tuple, kwargs: dict) -> Any:
    # Tensor.cuda() / Tensor.pin_memory(): the tensor is already where the CPU backend keeps it.
    return args[0]


def _no_op(func: Callable, args: tuple, kwargs: dict) -> None:
    # Tensor.record_stream(stream): there is one (implicit) stream on the CPU.
    return None


_TENSOR_METHOD_HANDLERS: dict[Callable, Callable] = {
    torch.Tensor.to: _tensor_to,
    torch.Tensor.cuda: _return_self,
    torch.Tensor.pin_memory: _return_self,
    torch.Tensor.record_stream: _no_op,
}


class CudaToCpuMode(TorchFunctionMode):
    """Torch function mode that sends CUDA device requests to the CPU and drops pinning.

    Applies to every torch function and tensor method called inside the mode on this thread:
    a ``device=`` keyword naming CUDA becomes ``cpu``; ``pin_memory=True`` becomes ``False``;
    ``Tensor.to(<cuda device>)`` goes to the CPU; ``Tensor.cuda()`` and ``Tensor.pin_memory()``
    return the tensor itself; ``Tensor.record_stream()`` does nothing. Raises nothing of its own.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        handler = _TENSOR_METHOD_HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class CpuGenerator(torch.Generator):
    """``torch.Generator`` whose CUDA device requests build a CPU generator.

    ``torch.Generator(device=torch.cuda.current_device())`` in megatron-core's text generation
    controller would otherwise need a GPU. Instances are ``torch.Generator`` instances.
    """

    def __new__(cls, device: Any = "cpu"):
        return super().__new__(cls, device=map_device(device))


class CpuEvent:
    """Stand-in for ``torch.cuda.Event``: everything has already happened on the CPU.

    ``elapsed_time`` returns wall-clock milliseconds between two recorded events.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self._time_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        """Note the current monotonic time (the CPU has already done all queued work)."""
        self._time_ns = time.monotonic_ns()

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always True: the event has completed."""
        return True

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        """Milliseconds from this event's ``record()`` to ``end_event``'s.

        Raises:
            RuntimeError: either event was never recorded.
        """
        if self._time_ns is None or end_event._time_ns is None:
            raise RuntimeError("CpuEvent.elapsed_time: both events must be recorded first")
        return (end_event._time_ns - self._time_ns) / 1e6


class CpuStream(torch.Stream):
    """Stand-in for ``torch.cuda.Stream``: one in-order CPU stream, so every wait is a no-op.

    A real ``torch.Stream`` (of the CPU device), so APIs that type-check their stream argument,
    such as ``Tensor.record_stream``, accept it.
    """

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any):
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        pass  # torch.Stream takes its arguments in __new__

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event or CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_DEFAULT_STREAM = CpuStream()


class CpuDeviceContext:
    """Stand-in for ``torch.cuda.device(index)``: there is one device, so selecting it does
    nothing. The Mamba Triton kernels' launchers (``causal_conv1d``, ``megatron.core.ssm.ops``)
    wrap each launch in ``with torch.cuda.device(x.device.index)``; the real one would initialize
    CUDA (the index of a CPU tensor is None, which it reads as "the current CUDA device")."""

    def __init__(self, device: Any = None):
        self.idx = 0

    def __enter__(self) -> "CpuDeviceContext":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CudaRng:
    """The "CUDA" RNG state that megatron-core saves, seeds and restores, kept on the CPU.

    Deliberately separate from ``torch``'s CPU default generator: ``torch.manual_seed`` calls
    ``torch.cuda.manual_seed_all`` once ``torch.cuda.is_available()`` is true, so a stand-in that
    seeded through ``torch.manual_seed`` would recurse.
    """

    def __init__(self) -> None:
        self.generator = torch.Generator(device="cpu")

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        self.generator.set_state(new_state)

    def manual_seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))

    def seed(self) -> None:
        self.generator.seed()

    def initial_seed(self) -> int:
        return self.generator.initial_seed()


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) host memory in bytes, read from ``sysconf``; the CPU's answer to CUDA's."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _device_properties(device: Any = None) -> SimpleNamespace:
    _, total = _mem_get_info()
    return SimpleNamespace(
        name="cpu", total_memory=total, multi_processor_count=os.cpu_count() or 1,
        major=0, minor=0, is_integrated=True,
    )


def _memory_stats(device: Any = None) -> dict[str, int]:
    """``torch.cuda.memory_stats`` on the CPU: no device memory. The engine's ``suspend()`` /
    ``resume()`` (0.17-0.19, ``suspend_resume_ctx``) read ``allocated_bytes.all.current`` and
    ``reserved_bytes.all.current`` from it."""
    return {"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0,
            "allocated_bytes.all.peak": 0, "reserved_bytes.all.peak": 0}


def _cuda_standins(rng: _CudaRng) -> dict[str, Any]:
    """Name -> stand-in for the ``torch.cuda`` (and ``torch.cuda.random``) functions replaced.

    Building and stepping the engine on 0.17.1 / 0.18.2 / 0.19.2 was seen to call
    ``current_device``, ``Event``, ``Stream`` (0.19), ``get_rng_state`` and ``manual_seed`` /
    ``manual_seed_all`` (via ``model_parallel_cuda_manual_seed`` and ``torch.manual_seed``), and
    (hybrid models, Mamba Triton kernel launchers) ``device``; the
    rest answer the timing, memory and capability queries of other engine paths and harnesses.
    """
    return {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device": CpuDeviceContext,
        "synchronize": lambda device=None: None,
        "Event": CpuEvent,
        "Stream": CpuStream,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "is_current_stream_capturing": lambda: False,
        "mem_get_info": _mem_get_info,
        "get_device_properties": _device_properties,
        "get_device_capability": lambda device=None: (0, 0),
        "get_device_name": lambda device=None: "cpu",
        "memory_stats": _memory_stats,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "get_rng_state": rng.get_rng_state,
        "set_rng_state": rng.set_rng_state,
        "manual_seed": rng.manual_seed,
        "manual_seed_all": rng.manual_seed,
        "seed": rng.seed,
        "seed_all": rng.seed,
        "initial_seed": rng.initial_seed,
    }


#: Names of the ``torch.cuda`` attributes :func:`cuda_on_cpu` replaces.
CUDA_STANDINS: tuple[str, ...] = tuple(_cuda_standins(_CudaRng()))

# torch.cuda.random holds its own references to the RNG functions; megatron-core calls
# torch.cuda.random.get_rng_state by that path.
_RANDOM_MODULE_NAMES = ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all",
                        "seed", "seed_all", "initial_seed")


@contextlib.contextmanager
def cuda_on_cpu(seed: int | None = None) -> Iterator[None]:
    """Within the block, megatron-core's CUDA requests are served on the CPU.

    Args:
        seed: initial seed of the stand-in CUDA RNG state (``torch.cuda.get_rng_state`` and
            friends); ``None`` leaves it at torch's default CPU-generator seed.

    Yields:
        None.

    Raises:
        RuntimeError: a real CUDA device is visible and already initialized; replacing
            ``torch.cuda`` then would mix real and fake devices.
    """
    if torch.cuda.is_initialized():
        raise RuntimeError("cuda_on_cpu: CUDA is already initialized in this process; "
                           "run the CPU backend in a process that has not touched the GPU")
    rng = _CudaRng()
    if seed is not None:
        rng.manual_seed(seed)
    swap = AttributeSwap()
    queued = _queued_cuda_calls()
    queued_before = len(queued)
    try:
        for name, standin in _cuda_standins(rng).items():
            swap.set(torch.cuda, name, standin)
            if name in _RANDOM_MODULE_NAMES:
                swap.set(torch.cuda.random, name, standin)
        swap.set(torch, "Generator", CpuGenerator)
        with CudaToCpuMode():
            yield
    finally:
        swap.restore()
        # megatron-core's _set_cuda_rng_state queues callbacks for "when CUDA initializes";
        # they hold CPU generator states that a real CUDA generator would reject later.
        del queued[queued_before:]


def _queued_cuda_calls() -> list:
    """torch's list of calls deferred until CUDA initializes (a private attribute; an empty
    stand-in list if this torch has none)."""
    queued = getattr(torch.cuda, "_queued_calls", None)
    return queued if isinstance(queued, list) else []
