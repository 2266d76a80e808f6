"""Restore loaded objects into live state: copy tensors in place, matching by structure."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._utils.cpus import affinity_cpus
from .._utils.devices import synchronize_current
from ..errors import LayoutMismatchError
from . import verify
from .state import FileSpec


def is_files(target: Any) -> bool:
    return isinstance(target, Mapping) and all(isinstance(v, FileSpec) for v in target.values()) and bool(target)


def copy_into_target(files: dict[str, Any], target_files: Mapping[str, Any],
                     locations: Mapping[int, str] | None = None,
                     fuse: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], list[Any]] | None = None
                     ) -> dict[str, Any]:
    """Copy loaded tensors into the target's; the rest are cloned.

    With ``locations`` (storage ``data_ptr`` -> saved location, from a load that kept every
    storage in the slot) the loaded tensors are host views of the slot: each is copied straight
    into its target (host-to-device, asynchronous from a page-locked slot: no second copy of the
    state on the device), and one that has no target is cloned onto its saved device. Returns
    once every copy has landed (the slot may be reused after).

    With ``fuse`` (see :meth:`.verify.SnapshotCheck.fuse`) the host copies are verified as they
    are made: ``fuse`` turns the pairs into ``(target, source, check)`` and checks whatever no
    copy covers; a mismatch raises :class:`~flashckpt_integrations.errors.CorruptCheckpointError`
    (the targets then hold part of the bad state: the caller restores another tier over them).
    """
    out = {}
    touched: list[torch.Tensor] = []
    host: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for path, loaded in files.items():
            target = target_files.get(path)
            target = target.obj if isinstance(target, FileSpec) else target
            out[path] = _merge(loaded, target, path, locations, touched, host)
    copy_on_host(fuse(host) if fuse is not None else host)
    synchronize_current(touched)
    return out


PARALLEL_MIN_BYTES = 64 << 20
"""Host copies smaller than this in all run on the calling thread (a thread costs more than it saves)."""


def copy_on_host(pairs: list[tuple[Any, ...]]) -> None:
    """``target.copy_(source)`` for every pair of host tensors (a third item, a region check of
    :mod:`.verify`, makes the copy checksum each chunk right after copying it, from cache), split by bytes over up to
    :func:`host_copy_threads` threads (the caller's among them). A restore holds up training until
    it ends, so the host's other cores are idle meanwhile, and one thread does not saturate memory
    bandwidth (a second one nearly halves a 1 GiB restore on two cores); ``torch.set_num_threads``
    limits torch's own operators, not these copies, which release the GIL."""
    sizes = [pair[0].numel() * pair[0].element_size() for pair in pairs]
    total, threads = sum(sizes), min(host_copy_threads(), len(pairs))
    if threads < 2 or total < PARALLEL_MIN_BYTES:
        _copy_pairs(pairs)
        return
    share, bounds, running = total / threads, [0], 0
    for index, size in enumerate(sizes):  # contiguous runs of about equal bytes
        running += size
        if running >= share * len(bounds) and len(bounds) < threads:
            bounds.append(index + 1)
    bounds.append(len(pairs))
    errors: list[Exception] = []
    helpers = [threading.Thread(target=_copy_pairs, args=(pairs[a:b], errors), name="flashckpt-restore", daemon=True)
               for a, b in zip(bounds[1:-1], bounds[2:])]
    for helper in helpers:
        helper.start()
    try:
        _copy_pairs(pairs[: bounds[1]])
    finally:
        for helper in helpers:
            helper.join()
    if errors:
        raise errors[0]


def host_copy_threads() -> int:
    """The threads a host restore copies with: the CPUs this process may run on, at most 4."""
    return min(4, affinity_cpus())


def _copy_pairs(pairs: list[tuple[Any, ...]], errors: list[Exception] | None = None) -> None:
    try:
        with torch.no_grad():  # grad mode is per thread
            for target, source, *check in pairs:
                if check and check[0] is not None:
                    _copy_checked(target, source, check[0])
                else:
                    target.copy_(source)
    except Exception as exc:  # a helper thread's error is raised on the caller's
        if errors is None:
            raise
        errors.append(exc)


def _copy_checked(target: torch.Tensor, source: torch.Tensor, check: Any) -> None:
    """Copy contiguous ``source`` into ``target`` a chunk at a time, summing each source chunk
    right after its copy (it is in cache then); raise when the sum is not the expected one."""
    dst = target.reshape(-1).view(torch.uint8)
    src = source.reshape(-1).view(torch.uint8)
    view = memoryview(src.detach().numpy())
    value = 0
    for start in range(0, len(view), verify.CHUNK):
        dst[start:start + verify.CHUNK].copy_(src[start:start + verify.CHUNK])
        value = verify.checksum(view[start:start + verify.CHUNK], value)
    if value != check.expected:
        raise check.failed()


def _merge(loaded: Any, target: Any, where: str, locations: Mapping[int, str] | None = None,
           touched: list[torch.Tensor] | None = None, host: list[tuple[torch.Tensor, torch.Tensor]] | None = None
           ) -> Any:
    """Copy ``loaded`` tensors into ``target``'s, matching by structure; clone the rest (under no_grad).
    With ``host``, host-to-host copies are listed there for the caller (:func:`copy_on_host`)."""
    if isinstance(loaded, torch.Tensor):
        if isinstance(target, torch.Tensor):
            if target.shape != loaded.shape or target.dtype != loaded.dtype:
                raise LayoutMismatchError(
                    f"{where}: saved tensor is {tuple(loaded.shape)} {loaded.dtype}, the target is "
                    f"{tuple(target.shape)} {target.dtype}"
                )
            if target.is_cpu:
                if loaded.is_cpu and loaded.data_ptr() == target.data_ptr() and loaded.stride() == target.stride():
                    return target  # read into it straight from the file (see .reading)
                if host is not None and loaded.is_cpu:
                    host.append((target, loaded))
                else:
                    target.copy_(loaded)
                return target
            async_copy = loaded.is_cpu
            target.copy_(loaded, non_blocking=async_copy)
            if async_copy and touched is not None:
                touched.append(target)
            return target
        location = locations.get(loaded.untyped_storage().data_ptr()) if locations else None
        with torch.set_grad_enabled(loaded.requires_grad):  # a clone keeps requires_grad, as it would outside
            if location is not None and not location.startswith("cpu"):
                return loaded.to(torch.device(location), copy=True)
            return loaded.clone()
    if isinstance(loaded, Mapping):
        items = {k: _merge(v, target.get(k) if isinstance(target, Mapping) else None, f"{where}.{k}",
                           locations, touched, host)
                 for k, v in loaded.items()}
        try:
            return type(loaded)(items)
        except TypeError:
            return items
    if isinstance(loaded, (list, tuple)) and not hasattr(loaded, "_fields"):
        targets = target if isinstance(target, (list, tuple)) and len(target) == len(loaded) else [None] * len(loaded)
        return type(loaded)(_merge(v, t, f"{where}[{i}]", locations, touched, host)
                            for i, (v, t) in enumerate(zip(loaded, targets)))
    return loaded
