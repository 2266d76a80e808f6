"""Pieces of loading a DeepSpeed checkpoint from shared memory: DeepSpeed's model-states loader
without its on-disk check, and sending a loaded file from the rank that holds it to the others."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from ..errors import FlashCkptError

try:
    from deepspeed.runtime.state_dict_factory import MegatronSDLoader
except ImportError as exc:  # pragma: no cover - exercised only without deepspeed
    from ..errors import missing_dependency

    raise missing_dependency("deepspeed", "deepspeed") from exc

_ALIGN = 64


class MemorySDLoader(MegatronSDLoader):
    """DeepSpeed's model-states loader without its check that the file exists on disk."""

    def load(self, mp_world_size: int, mp_rank: int, *args: Any, **kwargs: Any) -> Any:
        quantize = kwargs.get("quantize", args[2] if len(args) > 2 else False)
        if len(self.ckpt_list) != mp_world_size or quantize:
            return super().load(mp_world_size, mp_rank, *args, **kwargs)
        path = self.ckpt_list[mp_rank]
        return path, self.checkpoint_engine.load(path, map_location=lambda storage, loc: storage), (None, 1)


def memory_sd_loader(ckpt_list: list[str], checkpoint_engine: Any, sd_type: str = "Megatron",
                     version: Any = None) -> Any:
    """Stands in for ``SDLoaderFactory.get_sd_loader`` while a snapshot is served from memory."""
    if sd_type != "Megatron":
        raise FlashCkptError(f"{sd_type} checkpoints cannot be loaded from memory")
    return MemorySDLoader(ckpt_list, version, checkpoint_engine)


def broadcast_file(obj: Any, src: int, rank: int, group: Any = None) -> Any:
    """Send a loaded file from ``src`` to every rank of ``group``: its structure, then all its tensor
    bytes in one buffer (``broadcast_object_list`` of the tensors themselves is ~100x slower)."""
    header: list[Any] = [None]
    tensors: list[torch.Tensor] = []
    if rank == src:
        skeleton = _pickle_without_tensors(obj, tensors)
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total = (total + t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        metas = [(str(t.dtype).removeprefix("torch."), tuple(t.shape), off) for t, off in zip(tensors, offsets)]
        header = [(skeleton, metas, total)]
    dist.broadcast_object_list(header, src=src, group=group)
    skeleton, metas, total = header[0]
    buffer = torch.empty(total, dtype=torch.uint8)
    if rank == src:
        for t, (_, _, off) in zip(tensors, metas):
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[off:off + raw.numel()].copy_(raw)
    dist.broadcast(buffer, src=src, group=group)
    if rank == src:
        return obj
    views = []
    for dtype_name, shape, off in metas:
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        views.append(buffer[off:off + nbytes].view(dtype).view(shape))
    return _Unpickler(io.BytesIO(skeleton), views).load()


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
