"""Device-agnostic helpers for snapshots of accelerator tensors (CUDA and others alike)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def _all_devices(plan: Any) -> frozenset[torch.device]:
    found = getattr(plan, "device_set", None)  # a SnapshotPlan finds them once
    return found if found is not None else frozenset(r.source.device for r in plan.regions)


def on_device(plan: Any) -> bool:
    return any(device.type != "cpu" for device in _all_devices(plan))


def devices(plan: Any) -> set[torch.device]:
    return {device for device in _all_devices(plan) if device.type != "cpu"}


def synchronize_devices(plan: Any) -> None:
    """Wait for the copies queued on the current streams of the plan's devices (not NCCL's streams)."""
    synchronize_current(r.source for r in plan.regions)


# --- which devices a snapshot can hold --------------------------------------------------------


@functools.cache
def unsupported_device(device_type: str) -> str | None:
    """Why tensors on ``device_type`` cannot be snapshot, or ``None`` when they can."""
    if device_type == "cpu":
        return None
    if device_type == "meta":
        return ("it is a meta tensor, which has no data; materialise it (e.g. module.to_empty(device=...) and "
                "load or initialise its values) before saving")
    try:
        module = torch.get_device_module(device_type)
    except (RuntimeError, AttributeError):
        module = None
    if module is None or not hasattr(module, "synchronize"):
        return f"tensors on {device_type!r} cannot be copied into host memory by flashckpt; move them to CPU first"
    return None


def key_path(obj: Any, wanted: Any, where: str = "") -> str | None:
    """Where ``wanted`` sits inside ``obj`` (``['model']['w']``); for error messages only."""
    if obj is wanted:
        return where or "(the object itself)"
    items: Any = ()
    if isinstance(obj, Mapping):
        items = ((f"[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
        items = ((f".{k}", v) for k, v in vars(obj).items())
    for suffix, value in items:
        found = key_path(value, wanted, where + suffix)
        if found is not None:
            return found
    return None


def check_plan(plan: Any) -> None:
    """Refuse a plan with regions on devices a snapshot cannot copy from (before any slot is touched)."""
    for device in _all_devices(plan):
        reason = unsupported_device(device.type)
        if reason is not None:
            raise ValueError(f"cannot snapshot a tensor on {device}: {reason}")


# --- device-to-host copies on a side stream (the pattern of torch's _OverlappingCpuLoader) -----

_SIDE_STREAMS: dict[torch.device, Any] = {}
_SIDE_LOCK = threading.Lock()


def _has_streams(device: torch.device) -> bool:
    """CUDA, XPU, NPU, ... have streams; MPS has a single queue and no ``current_stream``."""
    module = torch.get_device_module(device.type)
    return hasattr(module, "current_stream") and hasattr(module, "Stream") and hasattr(module, "stream")


def _index(device: torch.device) -> torch.device:
    if device.index is not None or device.type == "mps":
        return device
    module = torch.get_device_module(device.type)
    return torch.device(device.type, module.current_device())


def side_stream(device: torch.device) -> Any:
    """This process's copy stream for ``device`` (one per device, made once, as torch's loader keeps one)."""
    device = _index(device)
    with _SIDE_LOCK:
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            module = torch.get_device_module(device.type)
            stream = _SIDE_STREAMS[device] = module.Stream(device=device)
        return stream


def blocking_event(device: torch.device) -> Any:
    """An event whose ``synchronize()`` sleeps instead of spinning a core (``torch.Event``'s flag is a no-op)."""
    module = torch.get_device_module(device.type)
    try:
        return module.Event(blocking=True)
    except TypeError:  # a backend whose Event takes no flags
        return torch.Event(device, blocking=True)


@dataclass
class DeviceCopy:
    """The device side of one snapshot: the side stream of each device and, once the copies are
    issued, the done event recorded on each."""

    streams: dict[torch.device, Any] = field(default_factory=dict)
    queues: list[torch.device] = field(default_factory=list)
    """Devices without streams (MPS): copied on the calling thread and synchronised."""
    done: list[Any] = field(default_factory=list)
    issued: threading.Event = field(default_factory=threading.Event)

    @property
    def empty(self) -> bool:
        return not self.streams and not self.queues


def begin_copy(plan: Any) -> DeviceCopy:
    """On the training thread: order each device's side stream after the work queued so far.

    ``side.wait_stream(current)`` is a device-side dependency: nothing waits on the host. Must run
    on the thread (and with the current streams) that produced the state.
    """
    copy = DeviceCopy()
    for device in devices(plan):
        if _has_streams(device):
            device = _index(device)
            module = torch.get_device_module(device.type)
            side = side_stream(device)
            side.wait_stream(module.current_stream(device))
            copy.streams[device] = side
        elif device not in copy.queues:
            copy.queues.append(device)
    if copy.empty:
        copy.issued.set()
    return copy


@contextlib.contextmanager
def on_side_streams(copy: DeviceCopy | None) -> Iterator[None]:
    """Make each device's side stream current on this thread (``torch.cuda.stream(side)``), so copies
    issued inside go there; on the way out record a blocking done event on each side stream."""
    if copy is None or copy.empty:
        yield
        return
    try:
        with contextlib.ExitStack() as stack:
            for device, side in copy.streams.items():
                stack.enter_context(torch.get_device_module(device.type).stream(side))
            yield
            for device, side in copy.streams.items():
                event = blocking_event(device)
                event.record(side)
                copy.done.append(event)
    finally:
        copy.issued.set()


def finish_copy(copy: DeviceCopy | None) -> None:
    """On the copy thread: wait (sleeping) until every issued copy has landed in host memory."""
    if copy is None:
        return
    for event in copy.done:
        event.synchronize()
    for device in copy.queues:  # MPS: synchronize() takes no device
        module = torch.get_device_module(device.type)
        try:
            module.synchronize(device)
        except TypeError:
            module.synchronize()


def drain(copy: DeviceCopy | None) -> None:
    """After a failed copy: let what was issued land before the slot is reused (best effort)."""
    if copy is None:
        return
    for side in copy.streams.values():
        with contextlib.suppress(Exception):
            side.synchronize()
    with contextlib.suppress(Exception):
        finish_copy(DeviceCopy(queues=copy.queues))


def wait_on_current_streams(copy: DeviceCopy) -> bool:
    """Make each device's current stream wait for the copy's done events (no host wait).

    Returns ``False`` when that cannot stand for a host wait (copies not issued yet, or a device
    without streams); the caller then waits on the host.
    """
    if not copy.streams or copy.queues or not copy.issued.is_set() or len(copy.done) != len(copy.streams):
        return False
    for (device, _), event in zip(copy.streams.items(), copy.done):
        torch.get_device_module(device.type).current_stream(device).wait_event(event)
    return True


def synchronize_current(tensors: Iterable[torch.Tensor]) -> None:
    """Wait (sleeping) for the work queued so far on the current stream of each tensor's device:
    not ``torch.cuda.synchronize(device)``, which also waits for NCCL's and every other stream."""
    for device in {t.device for t in tensors if t.device.type != "cpu"}:
        if _has_streams(device):
            device = _index(device)
            event = blocking_event(device)
            event.record(torch.get_device_module(device.type).current_stream(device))
            event.synchronize()
        else:
            with contextlib.suppress(TypeError):
                torch.get_device_module(device.type).synchronize()


def cuda_index_of(obj: Any) -> int | None:
    """The index of the first CUDA tensor inside ``obj`` (dicts, lists, tuples, FileSpecs), or None."""
    if isinstance(obj, torch.Tensor):
        return _index(obj.device).index if obj.device.type == "cuda" else None
    if hasattr(obj, "obj") and hasattr(obj, "codec"):  # a FileSpec
        return cuda_index_of(obj.obj)
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for value in values:
        found = cuda_index_of(value)
        if found is not None:
            return found
    return None


def device_index(plan: Any) -> int | None:
    """The CUDA device the plan's tensors are on (the one to page-lock host memory for)."""
    for device in devices(plan):
        if device.type == "cuda":
            return _index(device).index
    return None


# --- page-locking host memory for CUDA ---------------------------------------------------------

CUDA_HOST_REGISTER_PORTABLE = 1
"""The flag torch.cuda._pin_memory_utils passes (cudaHostRegisterPortable)."""
_PIN_FAILED: list[str] = []
"""Set on the first failed registration: this process does not try (or warn) again."""


def pin_failure() -> str | None:
    return _PIN_FAILED[0] if _PIN_FAILED else None


def clear_cuda_error() -> None:
    """Reset CUDA's sticky last error after a failed runtime call, so the next kernel launch on this
    thread does not raise it. Through torch's cudart bindings when they have cudaGetLastError, else
    through the libcudart that torch loaded (never a second copy of the runtime)."""
    cudart = torch.cuda.cudart()
    get_last = getattr(cudart, "cudaGetLastError", None)
    if get_last is not None:
        get_last()
        return
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


@functools.lru_cache(maxsize=1)
def _loaded_cudart() -> Any:
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            return ctypes.CDLL(path, mode=getattr(ctypes, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
    return None


def host_register(ptr: int, nbytes: int, device_index: int | None) -> str | None:
    """``cudaHostRegister`` one range for ``device_index`` (its context, not GPU 0's); the error or None."""
    if pin_failure() is not None:
        return pin_failure()
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device_index if device_index is not None else torch.cuda.current_device()):
        err = int(cudart.cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
        if err == 0:
            return None
        with contextlib.suppress(Exception):
            clear_cuda_error()
    reason = f"cudaHostRegister failed with cudaError {err}"
    with contextlib.suppress(Exception):
        reason += f" ({cudart.cudaGetErrorString(err)})"
    _PIN_FAILED.append(reason)
    return reason


def host_unregister(ptr: int, device_index: int | None) -> None:
    with torch.cuda.device(device_index if device_index is not None else torch.cuda.current_device()):
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            with contextlib.suppress(Exception):
                clear_cuda_error()
