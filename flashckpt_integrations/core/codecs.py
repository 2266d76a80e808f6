"""Codecs: read a snapshot's files back (from a slot or from storage), and the sizes of what
:mod:`.writing` writes.

Files read from storage are verified against the size and crc32 in the rank's done marker.
"""

from __future__ import annotations

import functools
import json
import struct
import sys
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from . import reading
from .shm_buffer import Slot
from .state import parse_safetensors_header, rebuild_safetensors, tensor_part_pickle, unpickle_torch
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
    target: Any = None,
    locations: dict[int, str] | None = None,
) -> Any:
    """Read a committed file through ``storage`` in one pass (:mod:`.reading`); ``expected`` (a
    marker entry) is verified. ``target`` and ``locations``: see :func:`.reading.read_torch`."""
    codec = Codec(codec)
    with reading.open_ranges(storage, path) as ranges:
        if codec is Codec.TORCH:
            return reading.read_torch(ranges, path, expected=expected, target=target, weights_only=weights_only,
                                      map_location=map_location, locations=locations)
        data = reading.read_bytes(ranges, path, expected=expected)
    if codec is Codec.SAFETENSORS:
        return _safetensors(data)
    return _decode_small(codec, bytes(data))


def _safetensors(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of the bytes just read (no copy); through
    ``safetensors.torch.load`` where a tensor does not start at a multiple of its element size
    (or the header names a dtype this package does not map)."""
    try:
        whole = torch.frombuffer(data, dtype=torch.uint8)
        (length,) = struct.unpack_from("<Q", data, 0)
        base = 8 + length
        header = parse_safetensors_header(data)
        views = [whole[base + start:base + end] for start, end in (info["data_offsets"] for info in header.values())]
        return rebuild_safetensors(bytes(data[:base]), views, copy=False)
    except (RuntimeError, ValueError, KeyError, TypeError, struct.error):
        from safetensors.torch import load as st_load

        return st_load(bytes(data))
