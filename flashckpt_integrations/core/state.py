"""Turn a rank's files into a snapshot plan, and turn a snapshot back into objects.

A rank saves ``files``: ``{relative path: FileSpec(obj, codec)}``. Packing a file never copies
tensor bytes; it produces

* ``regions``: the tensor bytes to copy into the slot, each a contiguous byte range. For the
  ``torch`` codec a region is a whole tensor storage, so tensors that share a storage are
  stored once and come back sharing (as ``torch.save`` does). For ``safetensors`` a region is
  one tensor, laid out contiguously as the format wants.
* one ``blob`` per file: the small non-tensor part (the pickle of a ``torch`` file, the header
  of a safetensors file, the bytes of a ``bytes``/``json`` file).
* JSON metadata telling the saver how to assemble each file from its blob and regions.

The saver writes files from that description alone: it never unpickles anything, so it never
needs the user's classes. Loading a ``torch`` file from memory goes through torch's
``weights_only`` unpickler; arbitrary objects need ``weights_only=False`` or
``torch.serialization.add_safe_globals``.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import pickle
import struct
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._utils.devices import key_path, unsupported_device
from .writing import Codec

ALIGN = 64


@dataclass
class FileSpec:
    """One file of a rank's checkpoint: the object and the codec that writes it."""

    obj: Any
    codec: Codec = Codec.TORCH
    metadata: dict[str, str] | None = None
    """safetensors only: the ``__metadata__`` string map of the file."""

    def __post_init__(self) -> None:
        self.codec = Codec(self.codec)


@dataclass
class Region:
    """A contiguous byte range of the slot and the tensor whose bytes go there."""

    source: torch.Tensor
    """A uint8 view of a whole storage (torch codec) or the tensor itself (safetensors)."""
    nbytes: int
    offset: int = -1


@dataclass
class FilePlan:
    path: str
    codec: Codec
    blob: bytes
    storages: dict[str, int] = field(default_factory=dict)
    """torch: storage key in ``data.pkl`` -> region index."""
    tensors: list[int] = field(default_factory=list)
    """safetensors: region indices in file order."""
    parts: list[list[int]] = field(default_factory=list)
    """parts: ``[start, end, region]`` per part; ``blob[start:end]`` is the part's bytes, or the
    pickle of its tensor when ``region >= 0``."""


@dataclass
class SnapshotPlan:
    regions: list[Region]
    files: list[FilePlan]

    @property
    def tensor_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    @functools.cached_property
    def device_set(self) -> frozenset[torch.device]:
        """The devices of the regions' tensors (found once: several checks of a save ask)."""
        return frozenset(r.source.device for r in self.regions)

    def layout(self, start: int) -> int:
        """Assign offsets to regions, then blobs, from ``start``; return the end offset."""
        offset = start
        for region in self.regions:
            region.offset = offset
            offset = align(offset + region.nbytes)
        self._blob_offsets = []
        for plan in self.files:
            self._blob_offsets.append(offset)
            offset = align(offset + len(plan.blob))
        return offset

    def metadata(self) -> dict[str, Any]:
        return {
            "regions": [[r.offset, r.nbytes] for r in self.regions],
            "files": [
                {
                    "path": f.path,
                    "codec": f.codec.value,
                    "blob": [off, len(f.blob)],
                    "storages": f.storages,
                    "tensors": f.tensors,
                    **({"parts": f.parts} if f.parts else {}),
                }
                for f, off in zip(self.files, self._blob_offsets)
            ],
        }

    def blobs(self) -> list[tuple[int, bytes]]:
        return [(off, f.blob) for f, off in zip(self.files, self._blob_offsets)]


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def normalize_files(files: Mapping[str, Any]) -> dict[str, FileSpec]:
    """Accept ``FileSpec``, ``(obj, codec)`` tuples or bare objects (torch codec)."""
    out: dict[str, FileSpec] = {}
    for path, spec in files.items():
        if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
            raise ValueError(
                f"file path {path!r} must be a non-empty relative path inside the step directory"
            )
        if isinstance(spec, FileSpec):
            out[path] = spec
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], (Codec, str)):
            out[path] = FileSpec(spec[0], Codec(spec[1]))
        else:
            out[path] = FileSpec(spec)
    return out


def plan_snapshot(files: Mapping[str, FileSpec], pickles: PickleCache | None = None) -> SnapshotPlan:
    """Pack ``files`` without copying tensor bytes; with ``pickles``, a torch file whose structure
    is that of the previous save's reuses its pickle."""
    regions: list[Region] = []
    by_storage: dict[int, int] = {}
    plans = []
    for path, spec in files.items():
        plan = pickles.plan(path, spec, regions, by_storage) if pickles is not None else None
        if plan is None:
            plan = _PACKERS[spec.codec](path, spec, regions, by_storage)
            if pickles is not None:
                pickles.remember(path, spec, plan, regions)
        plans.append(plan)
    return SnapshotPlan(regions, plans)


class PickleCache:
    """The pickle of each torch-codec file of a rank's previous save, reused while the file's
    structure stays the same (a training state's does from one save to the next).

    A torch file's pickle depends only on its structure and its values: container types and
    keys, each tensor's dtype, device, offset, size, stride and ``requires_grad``, which tensors,
    containers and storages are shared, each storage's size, and the plain values. The
    fingerprint of a file is that structure (objects by order of first appearance, never by
    ``id``, so a fresh ``state_dict()`` matches) with every ``int`` and ``float`` left out: those
    are written into a copy of the previous pickle in place (a learning rate, a step counter),
    each in the encoding the pickle has there (an ``int`` that does not fit it is a miss). Two
    files with equal fingerprints pickle to the same bytes up to those values and to the sharing
    of equal strings and tuples, which unpickle equal either way. A file holding anything else
    (another class, a tensor that is not plain) is pickled every time.
    """

    def __init__(self) -> None:
        self._cached: dict[str, _CachedPickle] = {}
        self._walked: tuple[str, Any, _Walk] | None = None
        self.hits = 0
        """Files whose pickle was reused."""

    def plan(self, path: str, spec: FileSpec, regions: list[Region], by_storage: dict[int, int]) -> FilePlan | None:
        self._walked = None
        if spec.codec is not Codec.TORCH:
            return None
        walk = _walk(spec.obj, stream=False)
        if walk is None:
            return None
        cached = self._cached.get(path)
        blob = cached.patched(walk) if cached is not None and cached.fingerprint == walk.fingerprint else None
        if blob is None:  # for remember(), right after this file is pickled (with the ints' order this time)
            self._walked = (path, spec.obj, _walk(spec.obj, stream=True))
            return None
        plan = FilePlan(path, Codec.TORCH, blob)
        for key, storage in enumerate(walk.storages):
            plan.storages[str(key)] = _storage_region(storage, regions, by_storage)
        self.hits += 1
        return plan

    def locate(self) -> None:
        """Find where the values of each remembered pickle sit now (what its first reuse would do)."""
        for cached in self._cached.values():
            cached.ready()

    def remember(self, path: str, spec: FileSpec, plan: FilePlan, regions: list[Region]) -> None:
        walked, self._walked = self._walked, None
        self._cached.pop(path, None)
        if walked is None or walked[0] != path or walked[1] is not spec.obj:
            return
        walk = walked[2]
        if len(plan.storages) != len(walk.storages) or any(  # the pickler met the storages in the walk's order
            regions[plan.storages.get(str(key), -1)].source.untyped_storage()._cdata != storage._cdata
            for key, storage in enumerate(walk.storages)
        ):
            return
        self._cached[path] = _CachedPickle.of(plan.blob, walk)


@dataclass
class _Walk:
    fingerprint: tuple[Any, ...]
    storages: list[torch.UntypedStorage]
    """Distinct storages, in the order the pickler meets them."""
    floats: list[float]
    ints: list[int]
    """The object's own ints (not the tensors' sizes), in pickling order."""
    stream: list[tuple[bool, int]]
    """Every int the pickle holds, in order: (the object's own, value); a tensor adds its storage's
    element count, its offset, sizes and strides."""


_INT_OPS = {"BININT1": (1, False), "BININT2": (2, False), "BININT": (4, True)}


@dataclass
class _CachedPickle:
    """A file's previous pickle; where its ints and floats sit is found the first time it is reused
    (a file whose structure changes at every save never pays for that scan)."""

    fingerprint: tuple[Any, ...]
    blob: bytes
    walk: _Walk | None
    """The values it was pickled from (no storages: nothing of the state is kept alive), until
    they are located."""
    floats: list[int] | None = None
    """Byte offsets of the object's floats (8 bytes, big-endian)."""
    ints: list[tuple[int, int, bool]] | None = None
    """(offset, width, signed) of the object's ints (little-endian)."""

    @classmethod
    def of(cls, blob: bytes, walk: _Walk) -> _CachedPickle:
        return cls(walk.fingerprint, blob, replace(walk, storages=[]))

    def _locate(self) -> bool:
        """Find where each int and float sits in the blob, once; false when they do not line up."""
        import pickletools

        walk, self.walk = self.walk, None
        if walk is None:
            return self.floats is not None
        floats: list[int] = []
        ints: list[tuple[int, int, bool]] = []
        stream = iter(walk.stream)
        blob = self.blob
        try:
            for op, arg, pos in pickletools.genops(blob):
                if op.name == "BINFLOAT":
                    if len(floats) >= len(walk.floats) or struct.pack(">d", arg) != struct.pack(
                            ">d", walk.floats[len(floats)]):
                        return False
                    floats.append(pos + 1)
                elif op.name in _INT_OPS or op.name == "LONG1" or op.name in ("INT", "LONG", "LONG4"):
                    own, value = next(stream)
                    if value != arg:
                        return False
                    if own:
                        if op.name in _INT_OPS:
                            width, signed = _INT_OPS[op.name]
                            ints.append((pos + 1, width, signed))
                        elif op.name == "LONG1":
                            ints.append((pos + 2, blob[pos + 1], True))
                        else:
                            return False
        except (StopIteration, ValueError):
            return False
        if len(floats) != len(walk.floats) or next(stream, None) is not None:
            return False
        self.floats, self.ints = floats, ints
        return True

    def ready(self) -> bool:
        """Whether the values' places in the blob are known (found now if they were not)."""
        return self.floats is not None or self._locate()

    def patched(self, walk: _Walk) -> bytes | None:
        """The cached pickle with ``walk``'s ints and floats; None when they cannot be located or an
        int does not fit its slot."""
        if not self.ready():
            return None
        blob = bytearray(self.blob)
        for offset, value in zip(self.floats, walk.floats):
            struct.pack_into(">d", blob, offset, value)
        for (offset, width, signed), value in zip(self.ints, walk.ints):
            try:
                blob[offset : offset + width] = value.to_bytes(width, "little", signed=signed)
            except OverflowError:
                return None
        return bytes(blob)


def _walk(obj: Any, stream: bool) -> _Walk | None:
    """The structure of a torch file's object (see :class:`PickleCache`), or ``None`` when it holds
    anything the cache does not reuse pickles for; ``stream``: with every int in pickling order
    (what locating the values in a new pickle needs, and a reuse does not)."""
    out: list[Any] = []
    seen: dict[int, int] = {}  # id -> order of first appearance (containers and tensors)
    storage_order: dict[int, int] = {}
    walk = _Walk((), [], [], [], [])
    stack = [obj]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is int:
            out.append(int)
            walk.ints.append(item)
            if stream:
                walk.stream.append((True, item))
            continue
        if kind is float:
            out.append(float)
            walk.floats.append(item)
            continue
        if kind is str or kind is bool or item is None:
            out.append((kind, item))
            continue
        if kind is torch.Tensor or kind is dict or kind is OrderedDict or kind is list:
            first = seen.get(id(item))
            if first is not None:  # met before: pickled as a reference
                out.append(("ref", first))
                continue
            seen[id(item)] = len(seen)
        if kind is torch.Tensor:
            dtype = item.dtype
            legacy = _LEGACY_STORAGE_TYPES.get(dtype, _UNKNOWN)
            if legacy is _UNKNOWN:
                legacy = _legacy_storage_type(dtype)
            if legacy is None or not _plain(item):
                return None
            storage = item.untyped_storage()
            order = storage_order.setdefault(storage._cdata, len(storage_order))
            if order == len(walk.storages):
                walk.storages.append(storage)
            size, stride, offset, nbytes = item.shape, item.stride(), item.storage_offset(), storage.nbytes()
            out.append((order, nbytes, dtype, item.device, offset, size, stride, item.requires_grad))
            if stream:
                walk.stream.extend((False, v) for v in (nbytes // dtype.itemsize, offset, *size, *stride))
        elif kind is dict or kind is OrderedDict:
            out.append((kind, len(item)))
            if kind is OrderedDict and vars(item):  # a state_dict's _metadata: pickled after the items
                out.append("attributes")
                stack.append(vars(item))
            for key, value in reversed(list(item.items())):
                stack.append(value)
                stack.append(key)
        elif kind is list or kind is tuple:
            out.append((kind, len(item)))
            stack.extend(reversed(item))
        else:
            return None
    walk.fingerprint = tuple(out)
    return walk


def _storage_region(storage: torch.UntypedStorage, regions: list[Region], by_storage: dict[int, int]) -> int:
    key = storage._cdata
    index = by_storage.get(key)
    if index is None:
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        index = len(regions)
        regions.append(Region(source, storage.nbytes()))
        by_storage[key] = index
    return index


class _StorageRef:
    """Stands for ``tensor.storage()`` in a pickle; never pickled itself (see persistent_id)."""

    __slots__ = ("storage", "dtype", "itemsize")

    def __init__(self, storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
        self.storage, self.dtype, self.itemsize = storage, dtype, dtype.itemsize


_STORAGE_TYPES = (torch.storage.TypedStorage, torch.UntypedStorage, _StorageRef)
_LEGACY_STORAGE_TYPES: dict[torch.dtype, Any] = {}
_UNKNOWN = object()


def _legacy_storage_type(dtype: torch.dtype) -> Any:
    """``torch.FloatStorage`` and friends: the class name ``torch.save`` puts in a pickle."""
    if dtype not in _LEGACY_STORAGE_TYPES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            typed = torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)
            try:
                _LEGACY_STORAGE_TYPES[dtype] = getattr(torch, typed._pickle_storage_type())
            except KeyError:  # newer dtypes (fp8, ...) have none: torch's own reduction handles them
                _LEGACY_STORAGE_TYPES[dtype] = None
    return _LEGACY_STORAGE_TYPES[dtype]


def _plain(tensor: torch.Tensor) -> bool:
    """A tensor whose pickle is exactly ``_rebuild_tensor_v2`` over its storage."""
    return (
        tensor.layout is torch.strided
        and (tensor.is_cpu or tensor.is_cuda)
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.__dict__
        and not torch._utils.get_tensor_metadata(tensor)
    )


def _pack_torch(path: str, spec: FileSpec, regions: list[Region], by_storage: dict[int, int]) -> FilePlan:
    plan = FilePlan(path, Codec.TORCH, b"")
    keys: dict[int, str] = {}
    dtypes: dict[int, torch.dtype] = {}

    class _Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            # Plain dense tensors: the same reduction as Tensor.__reduce_ex__, without building
            # a TypedStorage per tensor (half the cost of pickling a state dict).
            if type(obj) is not torch.Tensor or _legacy_storage_type(obj.dtype) is None or not _plain(obj):
                if isinstance(obj, torch.Tensor) and unsupported_device(obj.device.type) is not None:
                    where = key_path(spec.obj, obj) or "(inside an object)"
                    raise ValueError(f"{path}: cannot snapshot the tensor at {where}: "
                                     f"{unsupported_device(obj.device.type)}")
                return NotImplemented
            ref = _StorageRef(obj.untyped_storage(), obj.dtype)
            args = (ref, obj.storage_offset(), tuple(obj.size()), obj.stride(), obj.requires_grad, OrderedDict())
            return torch._utils._rebuild_tensor_v2, args

        def persistent_id(self, obj: Any) -> Any:
            if not isinstance(obj, _STORAGE_TYPES):  # called for every object pickled: keep it cheap
                return None
            if isinstance(obj, _StorageRef):
                storage, dtype = obj.storage, obj.dtype
                storage_type = _legacy_storage_type(dtype)
                numel = storage.nbytes() // obj.itemsize
            elif isinstance(obj, torch.storage.TypedStorage):
                storage = obj._untyped_storage
                dtype = obj.dtype
                storage_type = getattr(torch, obj._pickle_storage_type())
                numel = obj._size()
            else:
                storage, dtype, storage_type, numel = obj, torch.uint8, torch.UntypedStorage, obj.nbytes()
            if storage.data_ptr() != 0 and dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
                raise ValueError(
                    f"{path}: two tensors view the same storage as {dtypes[storage.data_ptr()]} "
                    f"and {dtype}; torch.load cannot restore that. Save a .clone() of one of them."
                )
            key = keys.setdefault(storage._cdata, str(len(keys)))
            plan.storages[key] = _storage_region(storage, regions, by_storage)
            location = torch.serialization.location_tag(storage)
            return ("storage", storage_type, key, location, numel)

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(spec.obj)
    plan.blob = buf.getvalue()
    return plan


_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
ST_DTYPE_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _pack_safetensors(path: str, spec: FileSpec, regions: list[Region], by_storage: dict[int, int]) -> FilePlan:
    obj = spec.obj
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise ValueError(f"{path}: the safetensors codec takes a flat dict of str -> torch.Tensor")
    header: dict[str, Any] = {}
    if spec.metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in spec.metadata.items()}
    seen: dict[tuple[int, int], str] = {}
    plan = FilePlan(path, Codec.SAFETENSORS, b"")
    offset = 0
    for name, tensor in obj.items():
        if tensor.dtype not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        if tensor.layout != torch.strided:
            raise ValueError(f"{path}: tensor {name!r} is {tensor.layout}; make it dense with .to_dense() first")
        if unsupported_device(tensor.device.type) is not None:
            raise ValueError(f"{path}: cannot snapshot tensor {name!r}: {unsupported_device(tensor.device.type)}")
        ident = (tensor.untyped_storage()._cdata, tensor.storage_offset())
        if tensor.numel() and ident in seen:
            raise ValueError(
                f"{path}: tensors {seen[ident]!r} and {name!r} share memory, which safetensors cannot "
                "represent; drop one of them (tied weights) or use the torch codec"
            )
        seen[ident] = name
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        plan.tensors.append(len(regions))
        regions.append(Region(tensor.detach(), nbytes))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    plan.blob = struct.pack("<Q", len(raw)) + raw
    return plan


def _pack_bytes(path: str, spec: FileSpec, regions: list[Region], by_storage: dict[int, int]) -> FilePlan:
    if not isinstance(spec.obj, (bytes, bytearray, memoryview)):
        raise ValueError(f"{path}: the bytes codec takes bytes, got {type(spec.obj).__name__}")
    return FilePlan(path, Codec.BYTES, bytes(spec.obj))


def _pack_json(path: str, spec: FileSpec, regions: list[Region], by_storage: dict[int, int]) -> FilePlan:
    try:
        blob = json.dumps(spec.obj, indent=2, sort_keys=False).encode()
    except TypeError as exc:
        raise ValueError(f"{path}: the json codec cannot encode this object: {exc}") from exc
    return FilePlan(path, Codec.JSON, blob)


def tensor_part_pickle(tensor: torch.Tensor) -> bytes:
    """``data.pkl`` of ``torch.save(tensor.detach().contiguous())`` when that tensor owns exactly its bytes."""
    return _part_pickle(tensor.dtype, tuple(tensor.shape))


@functools.lru_cache(maxsize=4096)
def _part_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    stride = torch.empty(shape, dtype=torch.uint8, device="meta").stride()
    storage_type = _legacy_storage_type(dtype)
    numel = math.prod(shape)
    args: tuple[Any, ...] = (_PART_STORAGE, 0, shape, stride, False, OrderedDict())
    rebuild = torch._utils._rebuild_tensor_v2
    if storage_type is None:  # fp8 and friends: torch.save's v3 reduction over untyped bytes
        storage_type, numel = torch.UntypedStorage, numel * dtype.itemsize
        rebuild = torch._utils._rebuild_tensor_v3
        args = (*args, dtype)
    buf = io.BytesIO()
    _PartPickler(buf, ("storage", storage_type, "0", "cpu", numel)).dump(_Reduced(rebuild, args))
    return buf.getvalue()


class _PartPickler(pickle.Pickler):
    def __init__(self, file: Any, storage_id: tuple[Any, ...]) -> None:
        super().__init__(file, protocol=2)
        self._storage_id = storage_id

    def persistent_id(self, obj: Any) -> Any:
        return self._storage_id if obj is _PART_STORAGE else None


class _PartStorage:
    """Stands for the storage of a part's tensor in its pickle."""


_PART_STORAGE = _PartStorage()


class _Reduced:
    __slots__ = ("reduction",)

    def __init__(self, rebuild: Any, args: tuple[Any, ...]) -> None:
        self.reduction = (rebuild, args)

    def __reduce__(self) -> Any:
        return self.reduction


def _pack_parts(path: str, spec: FileSpec, regions: list[Region], by_storage: dict[int, int]) -> FilePlan:
    if not isinstance(spec.obj, (list, tuple)):
        raise ValueError(f"{path}: the parts codec takes a list of bytes and tensors, got {type(spec.obj).__name__}")
    plan = FilePlan(path, Codec.PARTS, b"")
    blob = bytearray()
    for number, part in enumerate(spec.obj):
        start = len(blob)
        if isinstance(part, torch.Tensor):
            if not part.is_cpu and unsupported_device(part.device.type) is not None:
                raise ValueError(f"{path}: cannot snapshot part {number}: {unsupported_device(part.device.type)}")
            if part.layout is not torch.strided or part.is_quantized:
                raise ValueError(f"{path}: a part must be a dense tensor, got {part.layout}; use .to_dense() first")
            blob += tensor_part_pickle(part)
            plan.parts.append([start, len(blob), len(regions)])
            source = part.detach() if part.requires_grad else part
            regions.append(Region(source, part.numel() * part.element_size()))
        elif isinstance(part, (bytes, bytearray, memoryview)):
            blob += part
            plan.parts.append([start, len(blob), -1])
        else:
            raise ValueError(f"{path}: a part must be bytes or a tensor, got {type(part).__name__}")
    plan.blob = bytes(blob)
    return plan


_PACKERS = {
    Codec.TORCH: _pack_torch,
    Codec.SAFETENSORS: _pack_safetensors,
    Codec.BYTES: _pack_bytes,
    Codec.JSON: _pack_json,
    Codec.PARTS: _pack_parts,
}


def copy_regions(plan: SnapshotPlan, slot: torch.Tensor, on_copied: Any = None,
                 targets: dict[tuple[Any, ...], torch.Tensor] | None = None) -> None:
    """Copy every region's bytes into ``slot`` (a uint8 tensor over the slot), in order.

    ``on_copied(n)`` is called once the first ``n`` regions are in place (host copies only:
    device copies are asynchronous and complete together at the caller's synchronize).
    ``targets``: the views of ``slot`` the previous copy into it wrote through, reused where a
    region has the same place, dtype and shape (a state saved again; making the views is most
    of a small tensor's copy), and replaced by this copy's.
    """
    previous = targets if targets is not None else {}
    used: dict[tuple[Any, ...], torch.Tensor] = {}
    for index, region in enumerate(plan.regions):
        if region.nbytes:
            src = region.source
            key = (region.offset, region.nbytes, src.dtype, src.shape)
            dst = previous.get(key)
            if dst is None:
                dst = slot[region.offset : region.offset + region.nbytes]
                if src.dtype != torch.uint8 or src.dim() != 1:
                    dst = dst.view(src.dtype).view(src.shape)
            used[key] = dst
            dst.copy_(src, non_blocking=not src.is_cpu)
        if on_copied is not None:
            on_copied(index + 1)
    if targets is not None:
        targets.clear()
        targets.update(used)


# --- loading -------------------------------------------------------------------------------

SAFE_GLOBALS: list[Any] = [argparse.Namespace]
"""Classes the ``weights_only`` unpickler accepts beyond torch's defaults."""


def _restore_location(storage: torch.UntypedStorage, location: str, map_location: Any) -> torch.UntypedStorage:
    if map_location is None:
        return torch.serialization.default_restore_location(storage, location)
    if callable(map_location):
        result = map_location(storage, location)
        return storage if result is None else result
    device = torch.device(map_location if not isinstance(map_location, dict) else map_location.get(location, location))
    return storage if device.type == "cpu" else storage.to(device=device)


@functools.lru_cache(maxsize=64)
def _storage_dtype(storage_type: Any) -> torch.dtype:
    if storage_type is torch.UntypedStorage:
        return torch.uint8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # legacy storage classes warn on .dtype
        return storage_type.dtype


def unpickle_torch(
    blob: bytes,
    storage_for_key: Any,
    *,
    weights_only: bool = True,
    map_location: Any = None,
    copy: bool = True,
    refs: dict[str, int] | None = None,
) -> Any:
    """Rebuild a torch-codec object; ``storage_for_key(key)`` returns an untyped storage (no copy).

    With ``copy`` the tensors own fresh memory (one copy); without it they view the buffer.
    ``refs``, when given, counts the tensors that view each storage key.
    """
    cache: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: Any) -> Any:
        typename, storage_type, key, location, _numel = saved_id
        if isinstance(typename, bytes):
            typename = typename.decode()
        if typename != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {typename!r}")
        if isinstance(location, bytes):
            location = location.decode()
        if refs is not None:
            refs[key] = refs.get(key, 0) + 1
        if key not in cache:
            data = storage_for_key(key)
            if copy:
                data = data.clone()
            untyped = _restore_location(data, location, map_location)
            cache[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=_storage_dtype(storage_type),
                                                    _internal=True)
        return cache[key]

    unpickler = _AllowlistUnpickler(io.BytesIO(blob)) if weights_only else _SlotUnpickler(io.BytesIO(blob))
    unpickler.persistent_load = persistent_load
    return unpickler.load()


def _rebuild_tensor_v2(storage: Any, storage_offset: int, size: Any, stride: Any, requires_grad: bool,
                       backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` without its per-tensor fake-mode lookup (a snapshot is
    decoded outside fake mode: :func:`_rebuild_for` checks that once per file)."""
    untyped = storage._untyped_storage
    tensor = torch.empty((0,), dtype=storage.dtype, device=untyped.device).set_(untyped, storage_offset, size, stride)
    if requires_grad:
        tensor.requires_grad = True
    if metadata:
        torch._utils.set_tensor_metadata(tensor, metadata)
    if backward_hooks:
        tensor._backward_hooks = backward_hooks
    return tensor


def _rebuild_for(found: Any) -> Any:
    if found is torch._utils._rebuild_tensor_v2 and torch._guards.detect_fake_mode(None) is None:
        return _rebuild_tensor_v2
    return found


class _SlotUnpickler(pickle.Unpickler):
    """The plain unpickler (``weights_only=False``), with the fast tensor rebuild."""

    def find_class(self, module: str, name: str) -> Any:
        return _rebuild_for(super().find_class(module, name))


class _AllowlistUnpickler(pickle.Unpickler):
    """The C unpickler restricted to the globals torch's ``weights_only`` loading allows (its
    defaults, ``torch.serialization.add_safe_globals`` and :data:`SAFE_GLOBALS`).

    Every object an unpickler builds or calls comes from a global it resolved, so restricting
    :meth:`find_class` admits what torch's pure-Python ``weights_only`` unpickler admits, at C
    speed: it decodes a snapshot of hundreds of tensors in a fraction of its time. Used for
    memory snapshots (the rank's own private slot); files on storage load with ``torch.load``.
    """

    def find_class(self, module: str, name: str) -> Any:
        import _compat_pickle

        from torch import _weights_only_unpickler as wou

        if (module, name) in _compat_pickle.NAME_MAPPING:  # protocol-2 names (__builtin__.set), as pickle maps them
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        found = wou._get_allowed_globals().get(full)  # noqa: SLF001 - torch's own allowlist
        if found is None:
            found = {**wou._get_user_allowed_globals(), **_safe_globals()}.get(full)  # noqa: SLF001
        if found is None:
            raise pickle.UnpicklingError(
                f"the snapshot holds {full}, which torch's weights_only loading does not allow. If you "
                "trust it, allow it with torch.serialization.add_safe_globals([...]) or load with "
                "weights_only=False."
            )
        return _rebuild_for(found)


def _safe_globals() -> dict[str, Any]:
    return {f"{g.__module__}.{g.__qualname__}": g for g in SAFE_GLOBALS}


def parse_safetensors_header(blob: bytes) -> dict[str, Any]:
    (length,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8 : 8 + length])
    header.pop("__metadata__", None)
    return header


def rebuild_safetensors(blob: bytes, tensor_views: list[torch.Tensor], *, copy: bool = True) -> dict[str, torch.Tensor]:
    """Rebuild ``{name: tensor}`` from the header and uint8 views of each tensor's bytes."""
    header = parse_safetensors_header(blob)
    out = {}
    for (name, info), raw in zip(header.items(), tensor_views):
        tensor = raw.view(ST_DTYPE_NAMES[info["dtype"]]).view(info["shape"]) if raw.numel() else torch.empty(
            info["shape"], dtype=ST_DTYPE_NAMES[info["dtype"]]
        )
        out[name] = tensor.clone() if copy else tensor
    return out
