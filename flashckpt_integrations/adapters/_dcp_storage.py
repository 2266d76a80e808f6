"""DCP's restore from storage in one pass per file: a ``StorageReader`` over a committed step.

Call order (what ``dcp.load`` does with it; :func:`.dcp.load` builds it)::

    reader = CommittedReader(ck.storage, folder, entries)   # entries: Checkpointer.committed_entries(step)
    reader.read_metadata()          # the step's .metadata, through the checkpointer's storage
    reader.set_up_storage_reader(metadata, is_coordinator)
    reader.read_data(plan, planner) # every .distcp file this rank needs, read once, front to back

Stock ``FileSystemReader`` reads each item with its own buffered read, ``torch.load``s it into a
fresh tensor and copies that into the target: the disk's buffered speed at best and two copies.
This reader streams each file through :mod:`..core.reading` (large aligned reads, ``O_DIRECT``
where the file is not cached, a read-ahead thread), copies each item out of the read buffer into
one reused buffer, decodes the item's ``torch.save`` archive in place (its tensor views the
buffer) and copies it into the planner's target: one read and two warm copies per byte. A file
the plan reads at least half of is read whole and verified against the size and crc32 its rank
marker recorded; smaller parts of files (a restore onto more ranks) are read as ranges, as
stock DCP reads them, unverified. Any storage backend works (``open_ranges`` where it has it,
``open_read`` otherwise).
"""

from __future__ import annotations

import io
import mmap
import pickle
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..core import reading
from ..core.storage import Storage
from ..errors import FlashCkptError, LayoutMismatchError

METADATA_FILE = ".metadata"


class ItemReader(StorageReader):
    """What the adapter's DCP readers share: DCP's plans are used as they are, and a checkpoint
    id never picks one of them (the adapter hands them to ``dcp.load`` itself)."""

    storage_data: dict[Any, Any]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def commit_item(loaded: torch.Tensor, req: Any, planner: Any) -> None:
    """Copy the chunk ``req`` asks for out of the saved item ``loaded`` into the planner's target."""
    tensor = narrow_tensor_by_index(loaded, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise LayoutMismatchError(f"{req.storage_index.fqn}: checkpoint chunk {tuple(tensor.size())}, "
                                  f"target {tuple(target.size())}")
    with torch.no_grad():
        target.copy_(tensor)
    planner.commit_tensor(req, target)


class CommittedReader(ItemReader):
    """Read a committed DCP checkpoint at ``folder`` of ``storage`` (see the module's docstring).
    ``entries``: rank-marker entries by path relative to the step's folder (for verification);
    ``prefix``: where ``folder`` sits inside the step's folder."""

    def __init__(self, storage: Storage, folder: str, entries: dict[str, dict[str, Any]], prefix: str = "") -> None:
        super().__init__()
        self.storage, self.folder = storage, folder.rstrip("/")
        self.entries, self.prefix = entries, prefix.strip("/")
        self.storage_data: dict[Any, Any] = {}
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:  # read once: the adapter checks it, then dcp.load plans with it
            metadata = pickle.loads(self.storage.read(f"{self.folder}/{METADATA_FILE}"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self._metadata = metadata
        return self._metadata

    def read_data(self, plan: Any, planner: Any) -> Future:
        per_file: dict[str, list[tuple[Any, Any]]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise FlashCkptError(f"{info.relative_path}: items saved with transforms "
                                     f"({info.transform_descriptors}); load with dcp.FileSystemReader")
            per_file.setdefault(info.relative_path, []).append((info, req))
        for relative, items in per_file.items():
            items.sort(key=lambda pair: pair[0].offset)
            self._read_file(relative, items, planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_file(self, relative: str, items: list[tuple[Any, Any]], planner: Any) -> None:
        path = f"{self.folder}/{relative}"
        entry = self.entries.get(f"{self.prefix}/{relative}" if self.prefix else relative)
        largest = max(info.length for info, _ in items)
        buffer = mmap.mmap(-1, max(largest, mmap.PAGESIZE))  # reused by every item (warm after the first)
        with reading.open_ranges(self.storage, path) as ranges:
            whole = sum(info.length for info, _ in items) * 2 >= ranges.size
            if not whole:
                for info, req in items:
                    reading.read_range(ranges, path, info.offset, info.length, memoryview(buffer))
                    _deliver(buffer, info, req, planner, path)
                return
            reading.check_size(ranges, path, entry)
            source = reading.Source(ranges, path, tail_start=ranges.size)
            try:
                for info, req in items:
                    source.take(info.offset, info.length, memoryview(buffer))
                    _deliver(buffer, info, req, planner, path)
                crc = source.finish()
            finally:
                source.close()
        reading.check_crc(path, ranges.size, crc, entry)


def _deliver(buffer: Any, info: Any, req: Any, planner: Any, path: str) -> None:
    """Hand one item, read into ``buffer``, to the planner."""
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(bytes(memoryview(buffer)[:info.length])))
        return
    commit_item(reading.decode_torch(buffer, info.length, f"{path}@{info.offset}"), req, planner)


__all__ = ["CommittedReader", "ItemReader", "commit_item"]
