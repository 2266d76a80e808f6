"""A flash save strategy for megatron-core's ``dist_checkpointing`` (the ``torch_dist`` format).

```python
from megatron.core import dist_checkpointing
from flashckpt_integrations.adapters.megatron_core import FlashTorchDistSaveStrategy

strategy = FlashTorchDistSaveStrategy()            # one per job, on every rank
dist_checkpointing.save(sharded_state_dict, "ckpt/iter_0000100", sharded_strategy=strategy)
strategy.last_save.wait()                          # optional: until every rank's files are committed
state = dist_checkpointing.load(sharded_state_dict, "ckpt/iter_0000100")   # the stock loader
strategy.resumed_from("ckpt/iter_0000100")        # after a resume: before the first save, on every rank
```

``save`` translates the sharded state dict as megatron-core's ``TorchDistSaveShardedStrategy``
does, plans it with megatron-core's own DCP planner, copies every rank's shards into its
shared-memory slot and returns; the node's saver writes the standard ``torch_dist`` files
(``__<rank>_0.distcp`` and ``.metadata``) that the stock ``dist_checkpointing.load`` reads. (The
common state, ``args``, ``iteration`` and the like, is one of the shards, as megatron-core 0.19
stores it; older releases wrote it to ``common.pt``, which ``dist_checkpointing.save`` still does
there itself.) The
checkpoint directory's name carries the step (``iter_0000100``, ``step-100``): a checkpoint counts
once ``<parent>/.flashckpt/steps/<N>/COMMITTED`` exists (``metadata.json`` is written by
``dist_checkpointing.save`` itself, at once). ``persist=False`` keeps saves in memory only.
A job that resumed with the stock loader says so with :meth:`FlashTorchDistSaveStrategy.resumed_from`
before its first save: otherwise it counts as a fresh start, and once it saves, its restarts no
longer see the checkpoints of the run it resumed.

Only megatron-core is needed (any release with ``strategies.torch``, 0.16 and newer); for
Megatron-LM's ``save_checkpoint`` see :mod:`.megatron`, which uses the pieces below for
``--ckpt-format torch_dist``: :func:`snapshot_files` (a sharded state dict as the files of a
``torch_dist`` checkpoint; :class:`PlanningSaveStrategy` hands Megatron's to it) and
:class:`FlashTorchDistLoadShardedStrategy` (``dist_checkpointing.load`` reading the shards of a
memory snapshot, from this rank's slot and from the other ranks').
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import pickle
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as torch_dcp

from ..config import CheckpointerConfig
from ..core import collectives, reshard
from ..core.checkpointer import Checkpointer
from ..core.codecs import decode_from_slot, parts_layout
from ..core.layout import Layout
from ..core.results import SaveResult
from ..core.state import Codec, FileSpec
from ..errors import CheckpointNotFoundError, FlashCkptError, missing_dependency
from . import dcp as flash_dcp
from ._common import broadcast_bytes, check_in, declare_resume, log_save

try:
    from megatron.core.dist_checkpointing import serialization as _serialization
    from megatron.core.dist_checkpointing.strategies import torch as _torch_strategies
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise missing_dependency("megatron-core", "megatron") from exc

logger = logging.getLogger(__name__)

__all__ = [
    "FlashTorchDistLoadShardedStrategy",
    "FlashTorchDistSaveStrategy",
    "PlanningSaveStrategy",
    "SnapshotReader",
    "snapshot_files",
    "step_layout",
]

CONFIG_FILE = "metadata.json"
"""The file that makes a folder a ``dist_checkpointing`` checkpoint (backend and version)."""

_STEP_NAME = re.compile(r"(.*?)(\d+)")


def step_layout(checkpoint_dir: str | os.PathLike) -> tuple[str, int, Layout]:
    """The root, step and layout a checkpoint directory's name stands for (``ckpt/iter_0000100``:
    root ``ckpt``, step 100, ``iter_{step:07d}``)."""
    path = os.path.abspath(os.fspath(checkpoint_dir))
    name = os.path.basename(path)
    match = _STEP_NAME.fullmatch(name)
    if match is None:
        raise ValueError(
            f"checkpoint directory {path!r} does not end in a step number; flash checkpoints are kept per step, "
            "so name each checkpoint directory after its step (e.g. 'iter_0000100' or 'step-100')"
        )
    prefix, digits = match.groups()
    padded = len(digits) > 1 and digits.startswith("0")
    template = f"{prefix}{{step:0{len(digits)}d}}" if padded else f"{prefix}{{step}}"
    return os.path.dirname(path), int(digits), Layout(step_dir=template, tracker=None, staging=False)


class FlashTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's ``torch_dist`` save strategy, with the shards going through shared memory.

    ``persist``: write every save to storage (else keep it in memory only). ``config``: a
    :class:`~flashckpt_integrations.CheckpointerConfig` or a dict of its fields (retention, ...);
    the layout comes from the checkpoint directory's name. ``last_save`` is the
    :class:`~flashckpt_integrations.SaveResult` of the newest save.
    """

    def __init__(self, *, persist: bool = True, config: CheckpointerConfig | Mapping[str, Any] | None = None,
                 keep_only_main_replica: bool = True) -> None:
        super().__init__("torch_dist", 1, keep_only_main_replica=keep_only_main_replica)
        if isinstance(config, CheckpointerConfig):
            config = dataclasses.asdict(config)
        self.persist = persist
        self.last_save: SaveResult | None = None
        self._fields = {k: v for k, v in dict(config or {}).items() if k != "layout"}
        self._checkpointers: dict[tuple[str, str], Checkpointer] = {}
        if self._fields.get("async_snapshot"):
            logger.warning(
                "FlashTorchDistSaveStrategy with async_snapshot: the strategy has no optimizer, so nothing waits "
                "for the overlapped copy before the next step changes the parameters; the snapshot may then hold "
                "values of a later step. Attach the torch optimizers with "
                "strategy.checkpointer(checkpoint_dir).attach_optimizer(...) or leave async_snapshot off.")

    def checkpointer(self, checkpoint_dir: str | os.PathLike) -> Checkpointer:
        """The checkpointer that saves ``checkpoint_dir`` (one per parent directory and name pattern)."""
        root, _, layout = step_layout(checkpoint_dir)
        key = (root, layout.step_dir)
        if key not in self._checkpointers:
            self._checkpointers[key] = Checkpointer(root, CheckpointerConfig(**self._fields, layout=layout))
        return self._checkpointers[key]

    def resumed_from(self, checkpoint_dir: str | os.PathLike) -> None:
        """Say that this job resumed from ``checkpoint_dir`` (read by the stock ``dist_checkpointing.load``).

        Collective: every rank, before the first save into the same parent directory. Saves then
        continue the lineage of that checkpoint, so a restart still finds it (and the run's older
        commits) until newer ones are committed.
        """
        _, step, _ = step_layout(checkpoint_dir)
        declare_resume(self.checkpointer(checkpoint_dir), step)

    def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
        """Snapshot the shards into memory (and persist them); logs once (INFO) the time this call held training.

        That time covers this strategy's part of ``dist_checkpointing.save`` (translating, planning, the
        copy), not the stock steps around it (``common.pt``, ``metadata.json``, validation).
        """
        started = time.perf_counter()
        _, step, _ = step_layout(checkpoint_dir)
        ck = self.checkpointer(checkpoint_dir)
        files = snapshot_files(sharded_state_dict, process_group=ck.process_group,
                               keep_only_main_replica=self.keep_only_main_replica)
        self.last_save = ck.save(step, files=files, persist=self.persist)
        log_save(logger, ck.rank, "megatron-core dist_checkpointing.save", self.last_save,
                 os.path.abspath(os.fspath(checkpoint_dir)), time.perf_counter() - started)

    def async_save(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "FlashTorchDistSaveStrategy saves asynchronously by itself: call dist_checkpointing.save without "
            "async_sharded_save (it returns once the shards are in shared memory)"
        )

    def wait(self) -> None:
        """Wait until every persisting save is committed (or failed)."""
        for ck in self._checkpointers.values():
            ck.wait()

    def close(self) -> None:
        """Wait for in-flight persisting and free the shared memory."""
        for ck in self._checkpointers.values():
            ck.close()
        self._checkpointers.clear()


def snapshot_files(sharded_state_dict: Any, *, process_group: Any = None,
                   keep_only_main_replica: bool = True) -> dict[str, FileSpec]:
    """This rank's files of a ``torch_dist`` checkpoint of ``sharded_state_dict`` (collective).

    Translated and planned as ``TorchDistSaveShardedStrategy`` does (main replicas only, megatron-core's
    planner): ``__<rank>_0.distcp`` and, on the coordinator (rank 0), ``.metadata``. The files hold
    views of the live tensors, for ``Checkpointer.save(files=...)`` before the state changes.

    The first call plans with DCP (collectives that gather every rank's plan); a later call whose
    shards have the same keys, shapes, offsets and dtypes on every rank (agreed on in one exchange
    through the store) reuses that plan, and rank 0 only rewrites the offsets of the metadata when a
    serialized object changed its size.
    """
    state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica)
    key = (id(process_group), keep_only_main_replica)
    cached = _plans.get(key)
    signature = _signature(state)
    parts = cached.parts(state) if cached is not None and cached.signature == signature else None
    layout = parts_layout(parts) if parts is not None else None
    votes = check_in("megatron_snapshot_files", process_group, flash_dcp.COLLECTIVE_TIMEOUT_S,
                     vote=[cached.generation if cached else -1, layout])
    if parts is not None and all(v[0] == cached.generation and v[1] is not None for v in votes):
        files = {cached.name: FileSpec(parts, Codec.PARTS)}
        if cached.metadata is not None:
            files[flash_dcp.METADATA_FILE] = FileSpec(cached.metadata_for([v[1] for v in votes]), Codec.BYTES)
        return files
    planner = MCoreSavePlanner(dedup_replicated_tensors=not keep_only_main_replica,
                               flatten_state_dict=False, flatten_sharded_tensors=False)
    writer = flash_dcp.SnapshotWriter()
    torch_dcp.save(mcore_to_pyt_state_dict(state, False), storage_writer=writer, planner=planner,
                   process_group=process_group)
    _plans[key] = _Plan.of(max(v[0] for v in votes) + 1, signature, state, writer)
    return writer.files


@dataclasses.dataclass
class _Plan:
    """What the last full plan of a rank's shards decided, reused while their structure stays."""

    generation: int
    signature: tuple
    name: str
    sources: list[tuple[str, int, tuple[int, ...]] | tuple[str]] | None
    """Per part, in file order: ``(key, shard index, shape)`` of a tensor, ``(key,)`` of objects."""
    layout: list[tuple[int, int]]
    metadata: bytes | None
    """Rank 0: the pickled ``.metadata`` of that plan."""

    @classmethod
    def of(cls, generation: int, signature: tuple, state: dict[str, list[Any]], writer: Any) -> _Plan:
        sources: list[Any] | None = []
        parts = writer.files[writer.name].obj
        for item, part in zip(writer.items, parts):
            shards = state.get(item.index.fqn, [])
            if not isinstance(part, torch.Tensor):
                sources.append((item.index.fqn,))
                continue
            found = [i for i, sh in enumerate(shards) if tuple(sh.global_offset) == tuple(item.index.offset or ())]
            data = shards[found[0]].data if found else None
            if data is None or part.data_ptr() != data.data_ptr() or not part.is_contiguous() \
                    or not data.is_contiguous() or part.numel() != data.numel():
                sources = None  # a part that is not a plain view of a shard: plan every save
                break
            sources.append((item.index.fqn, found[0], tuple(part.shape)))
        metadata = writer.files.get(flash_dcp.METADATA_FILE)
        return cls(generation, signature, writer.name, sources, writer.layout,
                   metadata.obj if metadata is not None else None)

    def parts(self, state: dict[str, list[Any]]) -> list[Any] | None:
        """The parts of this plan over the current shards (views), or None when it cannot be reused."""
        if self.sources is None:
            return None
        out: list[Any] = []
        for source in self.sources:
            shards = state[source[0]]
            if len(source) == 1:  # as megatron-core serializes ShardedObjects (mcore_to_pyt_state_dict)
                data = io.BytesIO()
                torch.save([sh.data for sh in shards], data)
                out.append(data.getvalue())
            else:
                out.append(shards[source[1]].data.detach().view(source[2]))
        return out

    def metadata_for(self, layouts: list[list[list[int]]]) -> bytes:
        """Rank 0: the ``.metadata`` of this plan with every rank's current offsets and lengths."""
        assert self.metadata is not None
        metadata = pickle.loads(self.metadata)
        by_file: dict[str, list[Any]] = {}
        for index, info in metadata.storage_data.items():
            by_file.setdefault(info.relative_path, []).append((info.offset, index, info))
        changed = False
        for name, entries in by_file.items():
            match = _FILE_RANK.fullmatch(name)
            layout = layouts[int(match.group(1))] if match else None
            entries.sort(key=lambda e: e[0])
            if layout is None or len(layout) != len(entries):
                raise FlashCkptError(f"the cached plan of {name} holds {len(entries)} items, the rank saves "
                                     f"{None if layout is None else len(layout)}")
            for (_, index, info), (offset, length) in zip(entries, layout):
                if (info.offset, info.length) != (offset, length):
                    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=length)
                    changed = True
        if not changed:
            return self.metadata
        metadata.storage_meta = dataclasses.replace(metadata.storage_meta, save_id=str(uuid.uuid4())) \
            if metadata.storage_meta is not None else None
        return pickle.dumps(metadata)


_plans: dict[tuple[int, bool], _Plan] = {}
_FILE_RANK = re.compile(r"__(\d+)_\d+\.distcp")


def _signature(state: dict[str, list[Any]]) -> tuple:
    """Keys, shard shapes, offsets and dtypes of a rank's main replicas (not values)."""
    parts: list[tuple] = []
    for key, shards in state.items():
        for sh in shards:
            data = getattr(sh, "data", None)
            if isinstance(data, torch.Tensor):
                parts.append((key, type(sh).__name__, tuple(sh.global_shape), tuple(sh.global_offset),
                              tuple(data.shape), data.dtype, getattr(sh, "prepend_axis_num", 0),
                              getattr(sh, "flattened_range", None), getattr(sh, "axis_fragmentations", None)))
            else:
                parts.append((key, type(sh).__name__, tuple(sh.global_shape), tuple(sh.global_offset)))
    return tuple(parts)


class PlanningSaveStrategy(TorchDistSaveShardedStrategy):
    """A ``torch_dist`` save strategy whose ``save`` plans the shards into ``files``
    (:func:`snapshot_files`) and writes nothing: for callers that snapshot the files themselves
    (the Megatron-LM patch gives it to ``save_checkpoint``)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)
        self.files: dict[str, FileSpec] = {}

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        self.files = snapshot_files(sharded_state_dict, keep_only_main_replica=self.keep_only_main_replica)

    def async_save(self, *args: Any, **kwargs: Any) -> Any:
        raise FlashCkptError("PlanningSaveStrategy writes nothing, so there is nothing to do asynchronously: "
                             "call dist_checkpointing.save without async_sharded_save")


class SnapshotReader(flash_dcp.MemoryReader):
    """A DCP storage reader over the ranks' memory snapshots of one ``torch_dist`` checkpoint.

    Collective to make (rank 0's ``.metadata`` and small files go to every rank). Reading is
    collective too: each rank reads its own shards from its slot, and the shards that another rank
    saved (its main replicas, as ``--ckpt-fully-parallel-save`` spreads them) are sent by their owner.

    ``sources``: the snapshots that a job of another number of ranks left in memory
    (:func:`..core.reshard.open_sources`); each rank then serves the old ranks it was given, and
    the small files come from old rank 0's snapshot (sent by the rank that serves it).

    ``files``: the small files of (old) rank 0's snapshot, the ones that are neither shards nor
    ``.metadata`` (``metadata.json``, ``common.pt`` of older megatron-core), by path in the
    checkpoint folder. ``config``: its ``metadata.json``. ``elsewhere``: the small files that only
    other (old) ranks' snapshots hold (a reader of the checkpoint folder finds them only on storage).
    """

    def __init__(self, checkpointer: Checkpointer, step: int, sources: reshard.Sources | None = None) -> None:
        super().__init__(checkpointer, step, "", sources)
        if sources is None:
            served, first = {checkpointer.rank: checkpointer.memory_snapshots()[step]}, 0
        else:
            served, first = sources.slots, sources.choice.owners[0]
        names = {old: _small_files(meta) for old, (_, meta) in served.items()}
        packed = None
        if 0 in served:
            slot, meta = served[0]
            packed = _pack({f["path"]: bytes(decode_from_slot(slot, meta["regions"], f)) for f in names[0]})
        self.files: dict[str, bytes] = _unpack(broadcast_bytes(packed, checkpointer, src=first))
        views = collectives.all_gather_object(sorted({f["path"] for old, found in names.items() if old != 0
                                                      for f in found}), checkpointer.world_size,
                                              checkpointer.process_group)
        self.elsewhere: list[str] = sorted({path for view in views for path in view} - set(self.files))
        self.config: bytes | None = self.files.get(CONFIG_FILE)
        if self.config is None:
            raise CheckpointNotFoundError(f"the memory snapshot of step {step} holds no {CONFIG_FILE}")


def _small_files(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The files of a snapshot that are neither shards (``__<rank>_0.distcp``) nor ``.metadata``
    (only paths inside the checkpoint folder)."""
    return [f for f in meta["files"] if f["path"] != flash_dcp.METADATA_FILE
            and _FILE_RANK.fullmatch(os.path.basename(f["path"])) is None and f["codec"] == Codec.BYTES.value
            and not f["path"].startswith("/") and ".." not in f["path"].split("/")]


def _pack(files: Mapping[str, bytes]) -> bytes:
    """Files as one buffer: a JSON index (path, length) and then the bytes, for one broadcast."""
    index = json.dumps([[path, len(data)] for path, data in files.items()]).encode()
    return len(index).to_bytes(8, "little") + index + b"".join(files.values())


def _unpack(packed: bytes | None) -> dict[str, bytes]:
    if packed is None:
        return {}
    size = int.from_bytes(packed[:8], "little")
    position, files = 8 + size, {}
    for path, length in json.loads(packed[8:position]):
        files[path] = packed[position:position + length]
        position += length
    return files


class FlashTorchDistLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's ``torch_dist`` load strategy, reading the shards from a :class:`SnapshotReader`.

    Call its methods on every rank (a read exchanges shards between ranks). Everything else about
    the load (translating the sharded state dict, megatron-core's planner, shape checks, wrapping
    in ``FullyParallelLoadStrategyWrapper``) is the stock strategy's.
    """

    def __init__(self, reader: SnapshotReader, **kwargs: Any) -> None:
        kwargs.pop("checkpoint_name", None)
        super().__init__(**kwargs)
        self.reader = reader

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path, async_strategy: str = "mcore") -> Any:
        with reading_from(self.reader, _torch_strategies):
            return super().load(sharded_state_dict, checkpoint_dir, async_strategy)

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Any = None) -> Any:
        return super().load_tensors_metadata(checkpoint_dir, metadata if metadata is not None else self.reader.metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> Any:
        with reading_from(self.reader, _torch_strategies):
            return super().load_sharded_metadata(checkpoint_dir)


@contextlib.contextmanager
def reading_from(reader: SnapshotReader, module: Any = _serialization,
                 checkpoint_dir: str | None = None) -> Iterator[None]:
    """While the block runs, ``module``'s readers of ``checkpoint_dir`` (of any, by default) are ``reader``.

    ``module``: megatron-core's ``dist_checkpointing.serialization`` (its common-state load) or
    ``strategies.torch`` (the strategy's shard load); both make their reader with ``_get_filesystem_reader``.
    """
    stock = module._get_filesystem_reader
    wanted = os.path.abspath(checkpoint_dir) if checkpoint_dir is not None else None

    def get_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if wanted is None or os.path.abspath(os.fspath(path)) == wanted:
            return reader
        return stock(path, *args, **kwargs)

    module._get_filesystem_reader = get_reader
    try:
        yield
    finally:
        module._get_filesystem_reader = stock
