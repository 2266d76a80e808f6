"""Codecs: read a snapshot's files back (from a slot or from storage), and the sizes of what
:mod:`.writing` writes.

Files read from storage are verified against the size and crc32 in the rank's done marker.
"""

from __future__ import annotations

import functools
import io
import json
import sys
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from .layout import file_mismatch
from .shm_buffer import Slot
from .state import SAFE_GLOBALS, rebuild_safetensors, tensor_part_pickle, unpickle_torch
from .storage import Storage
from .torchzip import archive_size
from .writing import TORCH_STORAGE_ALIGNMENT, Codec


@functools.lru_cache(maxsize=4096)
def torch_file_size(pickle_len: int, nbytes: int) -> int:
    """Size of the file :func:`_write_torch` writes for one storage of ``nbytes`` (as ``torch.save``)."""
    return archive_size([
        ("data.pkl", pickle_len), (".format_version", 1), (".storage_alignment", len(str(TORCH_STORAGE_ALIGNMENT))),
        ("byteorder", len(sys.byteorder)), ("data/0", nbytes),
    ], alignment=TORCH_STORAGE_ALIGNMENT)


def parts_layout(parts: list[Any]) -> list[tuple[int, int]]:
    """``(offset, length)`` of each part in the file the parts codec writes for ``parts``."""
    out, offset = [], 0
    for part in parts:
        if isinstance(part, torch.Tensor):
            length = torch_file_size(len(tensor_part_pickle(part)), part.numel() * part.element_size())
        else:
            length = memoryview(part).nbytes
        out.append((offset, length))
        offset += length
    return out


def decode_from_slot(
    slot: Slot,
    regions: list[list[int]],
    fmeta: dict[str, Any],
    *,
    weights_only: bool = True,
    map_location: Any = None,
    copy: bool = True,
) -> Any:
    """Rebuild one file's object from a complete slot."""
    codec = Codec(fmeta["codec"])
    blob = slot.read_bytes(*fmeta["blob"])
    if codec is Codec.TORCH:
        storages = fmeta["storages"]

        def storage_for_key(key: str) -> torch.UntypedStorage:
            if key not in storages:
                raise CorruptCheckpointError(f"{fmeta['path']}: pickle names storage {key} that the slot lacks")
            offset, nbytes = regions[storages[key]]
            return slot.storage(offset, nbytes) if nbytes else torch.UntypedStorage(0)

        return unpickle_torch(blob, storage_for_key, weights_only=weights_only, map_location=map_location, copy=copy)
    if codec is Codec.SAFETENSORS:
        views = [slot.view(*regions[i]) for i in fmeta["tensors"]]
        return rebuild_safetensors(blob, views, copy=copy)
    if codec is Codec.PARTS:
        return [blob[start:end] if region < 0 else unpickle_torch(
            blob[start:end], lambda _key, r=region: _region_storage(slot, regions, r), weights_only=weights_only,
            map_location=map_location, copy=copy) for start, end, region in fmeta.get("parts", [])]
    return _decode_small(codec, blob)


def _region_storage(slot: Slot, regions: list[list[int]], index: int) -> torch.UntypedStorage:
    offset, nbytes = regions[index]
    return slot.storage(offset, nbytes) if nbytes else torch.UntypedStorage(0)


def _decode_small(codec: Codec, data: bytes) -> Any:
    if codec is Codec.JSON:
        return json.loads(data)
    return data


def read_file(
    storage: Storage,
    path: str,
    codec: Codec,
    *,
    expected: dict[str, Any] | None = None,
    weights_only: bool = True,
    map_location: Any = None,
) -> Any:
    """Read a committed file through ``storage``; ``expected`` (a marker entry) is verified."""
    data = storage.read(path)
    problem = file_mismatch(path, data, expected) if expected is not None else None
    if problem is not None:
        raise CorruptCheckpointError(problem)
    codec = Codec(codec)
    if codec is Codec.TORCH:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(io.BytesIO(data), weights_only=weights_only, map_location=map_location)
    if codec is Codec.SAFETENSORS:
        from safetensors.torch import load as st_load

        return st_load(data)
    return _decode_small(codec, data)
