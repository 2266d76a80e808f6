"""Sending a snapshot's files between ranks on a resume from memory.

Frameworks write replicated state once (DeepSpeed's model states on rank 0, Megatron's files on
data-parallel rank 0), so on a resume from memory a rank may need a file that only another rank's
slot holds. :func:`exchange` sends each such file from the lowest rank holding it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..core import collectives

_ALIGN = 64
_BATCH = 64 << 20


def exchange(own: Mapping[str, Any], needed: list[str], rank: int, world_size: int, group: Any = None,
             transfer_group: Any = None) -> dict[str, Any]:
    """The files of ``needed`` that this rank does not hold, from the ranks that do (collective).

    ``own`` maps this rank's file names to their loaded objects. Every rank learns which names
    every other rank holds and wants; each wanted name is broadcast once, by the lowest rank
    holding it, over ``transfer_group`` (a gloo group). Names nobody holds are left out: the
    framework's loader reports them as missing.
    """
    held = [set(names) for names in collectives.all_gather_object(sorted(own), world_size, group)]
    wanted = collectives.all_gather_object(sorted(n for n in needed if n not in own), world_size, group)
    mine = set(wanted[rank])
    received: dict[str, Any] = {}
    for name in sorted(set().union(*wanted)):
        holders = [r for r, names in enumerate(held) if name in names]
        if not holders:
            continue
        obj = broadcast_file(own.get(name), holders[0], rank, transfer_group)
        if name in mine:
            received[name] = obj
    return received


def gloo_group() -> Any:
    """The world group when it is gloo, else a new gloo group over every rank (collective)."""
    return dist.GroupMember.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def broadcast_file(obj: Any, src: int, rank: int, group: Any = None) -> Any:
    """Send a loaded file from ``src`` to every rank of ``group``: its structure, then its tensor bytes
    in batches of up to 64 MiB (``broadcast_object_list`` of the tensors themselves is ~100x slower).

    Every received tensor has a storage of its own, as after ``torch.load`` (``torch.set_rng_state``
    and ``torch.save`` rely on that), and at most one batch is held twice.
    """
    header: list[Any] = [None]
    tensors: list[torch.Tensor] = []
    if rank == src:
        skeleton = _pickle_without_tensors(obj, tensors)
        header = [(skeleton, [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors])]
    dist.broadcast_object_list(header, src=src, group=group)
    skeleton, metas = header[0]
    if rank != src:
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in metas]
    for batch in _batches(tensors):
        offsets, total = [], 0
        for t in batch:
            offsets.append(total)
            total = (total + t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        buffer = torch.empty(total, dtype=torch.uint8)
        for t, off in zip(batch, offsets):
            if rank == src:
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                buffer[off:off + raw.numel()].copy_(raw)
        dist.broadcast(buffer, src=src, group=group)
        if rank != src:
            for t, off in zip(batch, offsets):
                flat = t.view(-1).view(torch.uint8)
                flat.copy_(buffer[off:off + flat.numel()])
    return obj if rank == src else _Unpickler(io.BytesIO(skeleton), tensors).load()


def _batches(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    batches: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if batches[-1] and size + nbytes > _BATCH:
            batches.append([])
            size = 0
        batches[-1].append(t)
        size += nbytes
    return [b for b in batches if b]


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.tensors[pid]


def _pickle_without_tensors(obj: Any, tensors: list[torch.Tensor]) -> bytes:
    out = io.BytesIO()
    _Pickler(out, tensors).dump(obj)
    return out.getvalue()
