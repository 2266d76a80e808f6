"""Flash checkpoints in the format of ``torch.distributed.checkpoint`` (DCP), for sharded state.

```python
from flashckpt_integrations import Checkpointer
from flashckpt_integrations.adapters import dcp as flash_dcp

ck = Checkpointer("ckpt", flash_dcp.checkpointer_config())
state = {"model": model, "optimizer": optimizer}          # FSDP2 / DTensor / plain / pipeline stages
flash_dcp.save(ck, step, state)                            # collective; one memory copy, then returns
flash_dcp.save(ck, step, state, persist=False)             # memory only
result = flash_dcp.load(ck, state)                         # newest of: memory snapshot, committed step
```

Every rank's shard goes into its shared-memory slot in one ``Checkpointer.save``; the node's saver
writes the stock DCP layout, which ``torch.distributed.checkpoint.load`` reads without this package::

    <root>/step-<N>/__<rank>_0.distcp    the rank's items: raw bytes, then one torch.save file per tensor
    <root>/step-<N>/.metadata            pickled ``Metadata`` (offsets of every item), written by rank 0
    <root>/latest                        "<N>": the newest committed step
    <root>/.flashckpt/steps/<N>/COMMITTED

``step-<N>`` appears (renamed from ``.flashckpt/staging/``) only once every rank's files are durable,
so a directory with ``.metadata`` is always complete. ``folder`` puts the DCP files in a sub-folder
of the step directory, so that several DCP checkpoints and other files share one step (as
accelerate's ``pytorch_model_fsdp_0/`` and ``optimizer_0/``): build each one's files with
:func:`dcp_files`, merge them, and save them with one ``Checkpointer.save``.

Values of the state may be ``nn.Module`` and ``torch.optim.Optimizer`` (wrapped in
:class:`ModelState` / :class:`OptimizerState`: FQN-keyed, optimizer state flattened by FQN, as
``torch.distributed.checkpoint.state_dict`` makes them), other ``Stateful`` objects, or state dicts.
With pipeline parallelism each rank passes its stage module(s): keys are the original model's FQNs,
so a checkpoint loads into another pipeline layout.

Loading from memory serves the same number of ranks from their own slots, and another number of
ranks (a job restarted on fewer or more nodes) from the old ranks' snapshots left in the new job's
memory, their slots and peer replicas (:mod:`..core.reshard`); items held by another rank's slot
(replicated values, which DCP saves once, or an old rank another rank serves) are sent over the
process group. Loading from storage reshards freely;
it reads each ``.distcp`` file once (``_dcp_storage.CommittedReader``), verifies every file a rank
reads whole against its rank marker, and on a mismatch every rank loads the next older commit.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from ..config import CheckpointerConfig
from ..core import collectives, reshard
from ..core.checkpointer import Checkpointer
from ..core.codecs import decode_from_slot, parts_layout
from ..core.layout import Layout
from ..core.results import SaveResult
from ..core.state import Codec, FileSpec
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FlashCkptError,
    LayoutMismatchError,
    missing_dependency,
)
from ._common import broadcast_bytes, check_in, declare_resume, log_save, step_destination, verified_choice
from .pipeline import ModelState, OptimizerState, as_stateful

try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
    from torch.futures import Future

    from ._dcp_storage import CommittedReader, ItemReader, commit_item
except ImportError as exc:  # pragma: no cover - torch built without distributed
    raise missing_dependency("torch.distributed.checkpoint", "dcp") from exc

logger = logging.getLogger(__name__)

__all__ = [
    "LAYOUT",
    "ModelState",
    "OptimizerState",
    "checkpointer_config",
    "dcp_files",
    "load",
    "resolve_step",
    "save",
]

LAYOUT = Layout(step_dir="step-{step}", tracker="latest", staging=True)
"""``step-<N>/`` with the DCP files, ``latest`` tracker, directory renamed into place at commit."""
METADATA_FILE = ".metadata"
DCP_VERSION = "1.0.0"
"""``Metadata.version`` that ``FileSystemWriter`` of torch 2.13 writes."""
COLLECTIVE_TIMEOUT_S = 300.0
"""How long save/load wait for every rank to join before failing (not hanging)."""
_FILE_RANK = re.compile(r"__(\d+)_\d+\.distcp$")


def checkpointer_config(**fields: Any) -> CheckpointerConfig:
    """A :class:`CheckpointerConfig` with the DCP layout (``step-<N>/``, ``latest``, staged)."""
    return CheckpointerConfig(**{**fields, "layout": LAYOUT})


# --- saving ----------------------------------------------------------------------------------


def _join(folder: str, name: str) -> str:
    folder = folder.strip("/")
    return f"{folder}/{name}" if folder else name


class SnapshotWriter(StorageWriter):
    """A DCP storage writer that lays out each rank's ``.distcp`` file as ``files`` for the core.

    Call order (DCP): reset -> set_up_storage_writer -> prepare_local_plan -> (coordinator)
    prepare_global_plan -> write_data -> (coordinator) finish. Nothing is copied or written here:
    ``write_data`` records the rank's items (views of the live tensors) and their offsets in the
    file, ``finish`` pickles the metadata; ``Checkpointer.save`` then copies the tensors into memory
    and the saver writes the files.
    """

    def __init__(self, folder: str = "") -> None:
        super().__init__()
        self.folder = folder
        self.files: dict[str, FileSpec] = {}
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.items: list[Any] = []
        self.name = ""
        self.layout: list[tuple[int, int]] = []

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.files = {}
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank") or 0

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_")) for i, plan in enumerate(plans)]

    def write_data(self, plan: Any, planner: Any) -> Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        # FileSystemWriter's order within a file: byte items first, then tensors
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        parts = [_resolved(planner, item) for item in items]
        results = [
            WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
            for item, (offset, length) in zip(items, parts_layout(parts))
        ]
        self.files[_join(self.folder, name)] = FileSpec(parts, Codec.PARTS)
        self.items, self.name, self.layout = items, name, parts_layout(parts)
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        self.files[_join(self.folder, METADATA_FILE)] = FileSpec(pickle.dumps(metadata), Codec.BYTES)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.folder or None, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


@dataclasses.dataclass
class _Plan:
    """What the last full DCP save of a folder decided, reused while nothing about the state changes."""

    generation: int
    signature: tuple
    items: list[Any]
    name: str
    layout: list[tuple[int, int]]
    metadata: bytes | None


_plans: dict[tuple[str, int], _Plan] = {}


def dcp_files(
    state: Mapping[str, Any],
    *,
    folder: str = "",
    process_group: Any = None,
    planner: Any = None,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> dict[str, FileSpec]:
    """This rank's files of a DCP checkpoint of ``state``, to pass to ``Checkpointer.save(files=...)``.

    Collective (every rank of ``process_group`` calls it). The files hold views of the live
    tensors: save them before the state changes. The first call plans the checkpoint with DCP
    (collectives that gather every rank's plan); later calls whose state has the same structure
    and item sizes on every rank reuse that plan and its metadata, agreed on in one exchange.
    """
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    state_dict = _stateful_to_state_dict(as_stateful(state))
    key = (folder, id(process_group))
    cached = _plans.get(key) if planner is None else None
    files = None
    signature: tuple = ()
    if planner is None:  # a custom planner plans every save itself
        flat = _flatten(state_dict)
        signature = _signature(flat)
        if cached is not None and cached.signature == signature:
            files = _files_from_plan(cached, flat, state_dict, folder)
    votes = check_in("dcp_files", process_group, timeout_s, vote=[cached.generation if cached else -1,
                                                                    files is not None])
    if files is not None and all(v == [cached.generation, True] for v in votes):
        return files
    writer = SnapshotWriter(folder)
    dcp.save(state_dict, storage_writer=writer, planner=planner or dcp.DefaultSavePlanner(),
             process_group=process_group)
    if planner is None:
        metadata = writer.files.get(_join(folder, METADATA_FILE))
        _plans[key] = _Plan(max(v[0] for v in votes) + 1, signature, writer.items, writer.name, writer.layout,
                            metadata.obj if metadata is not None else None)
    return writer.files


def _flatten(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state as DCP's default planner addresses it: one level, dotted keys."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state_dict)[0]


def _local(value: Any) -> torch.Tensor:
    """A DTensor's local shard (its attribute: ``to_local()`` is an autograd call per tensor)."""
    local = getattr(value, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else value.to_local()


def _signature(flat: dict[str, Any]) -> tuple:
    """Keys, types, shapes, dtypes and shard placements of the flattened state (not values)."""
    from torch.distributed.tensor import DTensor

    parts: list[tuple] = []
    for name, value in flat.items():
        if isinstance(value, DTensor):
            parts.append((name, DTensor, value.dtype, value.shape, value.placements, id(value.device_mesh),
                          _local(value).shape))
        elif isinstance(value, torch.Tensor):
            parts.append((name, type(value), value.dtype, value.shape))
        else:
            parts.append((name, type(value)))
    return tuple(parts)


def _files_from_plan(plan: _Plan, flat: dict[str, Any], state_dict: dict[str, Any],
                     folder: str) -> dict[str, FileSpec] | None:
    """The files of ``plan`` over the current values, or None when an item's size changed.

    Resolves each item as DCP's default planner does: the local shard of a DTensor, a plain
    tensor as it is, anything else ``torch.save``d; other tensor types (ShardedTensor) go
    through the planner itself.
    """
    from torch.distributed.tensor import DTensor

    parts: list[Any] = []
    for item in plan.items:
        value = flat.get(item.index.fqn)
        if item.type == WriteItemType.BYTE_IO:
            data = io.BytesIO()
            torch.save(value, data)
            parts.append(data.getvalue())
        elif type(value) is DTensor and type(local := _local(value)) is torch.Tensor:
            parts.append(local.detach())
        elif type(value) in (torch.Tensor, torch.nn.Parameter) and not any(item.index.offset or ()):
            parts.append(value.detach())
        else:
            parts = _parts_by_planner(plan, state_dict)
            break
    if parts_layout(parts) != plan.layout:
        return None
    files = {_join(folder, plan.name): FileSpec(parts, Codec.PARTS)}
    if plan.metadata is not None:
        files[_join(folder, METADATA_FILE)] = FileSpec(plan.metadata, Codec.BYTES)
    return files


def _parts_by_planner(plan: _Plan, state_dict: dict[str, Any]) -> list[Any]:
    planner = dcp.DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=plan.metadata is not None)
    return [_resolved(planner, item) for item in plan.items]


def _resolved(planner: Any, item: Any) -> Any:
    """An item's part as the planner resolves it: bytes, or a detached tensor (a view, no copy)."""
    data = planner.resolve_data(item)
    return data.getvalue() if isinstance(data, io.BytesIO) else data.detach()


def save(
    checkpointer: Checkpointer,
    step: int,
    state: Mapping[str, Any],
    *,
    persist: bool = True,
    folder: str = "",
    planner: Any = None,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> SaveResult:
    """Snapshot ``state`` as a DCP checkpoint of ``step`` (collective); see the module doc.

    The result's ``blocking_s`` is the whole call (planning and the copy); it is logged once (INFO)
    with where the step lands.
    """
    started = time.perf_counter()
    files = dcp_files(state, folder=folder, process_group=checkpointer.process_group, planner=planner,
                      timeout_s=timeout_s)
    result = checkpointer.save(step, files=files, persist=persist)
    result.blocking_s = time.perf_counter() - started
    log_save(logger, checkpointer.rank, "DCP save", result, step_destination(checkpointer, step), result.blocking_s)
    return result


# --- loading ---------------------------------------------------------------------------------


@dataclasses.dataclass
class DcpLoadResult:
    step: int
    source: str
    """``"memory"`` or ``"storage"``."""
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    """Committed steps that failed verification and were passed over, with why."""


def resolve_step(checkpointer: Checkpointer, step: int | None = None, *,
                 prefer_memory: bool = True) -> tuple[int, str] | None:
    """The step and source (``"memory"`` / ``"storage"``) a load would use (collective).

    Memory when every rank holds a complete snapshot of the step and it is at least as new as the
    newest commit, and every rank's copy verifies (``Checkpointer.check_memory``: one that fails is
    discarded, and the choice is made again); else the newest (or the given) committed step;
    ``None`` when there is none.
    """
    return verified_choice(checkpointer, lambda: _resolve_once(checkpointer, step, prefer_memory))


def _resolve_once(ck: Checkpointer, step: int | None, prefer_memory: bool) -> tuple[int, str] | None:
    if prefer_memory:  # a rank whose node lost its memory fetches the step from a peer's replica
        ck.recover_replicas(step)
    memory = ck.memory_steps() if prefer_memory else []
    committed = ck.committed_steps()
    views = collectives.all_gather_object([memory, committed], ck.world_size, ck.process_group)
    in_memory = set.intersection(*(set(v[0]) for v in views))
    committed = views[0][1]
    if step is None:
        newest = committed[-1] if committed else None
        eligible = [s for s in in_memory if newest is None or s >= newest]
        if eligible:
            return max(eligible), "memory"
        return (newest, "storage") if newest is not None else None
    if step in in_memory:
        return step, "memory"
    if step in committed:
        return step, "storage"
    raise CheckpointNotFoundError(f"step {step} is neither held in memory by every rank nor committed in "
                                  f"{ck.url}; committed steps: {committed}")


def load(
    checkpointer: Checkpointer,
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    folder: str = "",
    prefer_memory: bool = True,
    planner: Any = None,
    strict: bool = True,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    sources: reshard.Sources | None = None,
) -> DcpLoadResult | None:
    """Load the newest DCP checkpoint (or ``step``) into ``state`` in place (collective).

    ``None`` when there is no checkpoint. With ``strict`` a key of ``state`` missing from the
    checkpoint, or a tensor of another shape, raises :class:`LayoutMismatchError` listing them all.
    When this job's own memory holds no step at least as new as the newest commit, the snapshots
    that a job of another number of ranks left in the new job's memory serve the newest step they
    all hold (:mod:`..core.reshard`), before storage. ``sources``: those snapshots, opened by the
    caller (``reshard.open_sources``) to read several folders of one step; the caller closes them.
    """
    ck = checkpointer
    group = ck.process_group
    check_in("load", group, timeout_s)
    if sources is not None:  # the caller's choice, for every folder of the step
        return _load_step(ck, as_stateful(state), (sources.choice.step, "memory"), explicit=True, folder=folder,
                          planner=_planner(planner, strict), strict=strict, sources=sources)
    chosen = resolve_step(ck, step, prefer_memory=prefer_memory)
    if prefer_memory and step is None and (chosen is None or chosen[1] == "storage"):
        # no step in this job's own memory: the old ranks' snapshots of a job of another number of ranks
        sources = reshard.open_sources(ck, None if chosen is None else chosen[0])
        if sources is not None:
            chosen = (sources.choice.step, "memory")
    if chosen is None:
        return None
    try:
        return _load_step(ck, as_stateful(state), chosen, explicit=step is not None, folder=folder,
                          planner=_planner(planner, strict), strict=strict, sources=sources)
    finally:
        if sources is not None:
            sources.close()


def _planner(planner: Any, strict: bool) -> Any:
    if planner is None and not strict:
        return dcp.DefaultLoadPlanner(allow_partial_load=True)
    return planner


def _load_step(ck: Checkpointer, stateful: dict[str, Any], chosen: tuple[int, str], *, explicit: bool, folder: str,
               planner: Any, strict: bool, sources: reshard.Sources | None) -> DcpLoadResult:
    """Read ``chosen`` (step, source) into ``stateful`` (collective); a committed step that fails
    verification gives way to the next older one, unless the step was asked for."""
    group = ck.process_group
    step, source = chosen
    started = time.perf_counter()
    fallbacks: list[str] = []
    while True:
        if source == "memory":  # read by DCP's loader from the slots, not by Checkpointer.load
            declare_resume(ck, step, source, tag=sources.tag if sources is not None else None)
            reader: StorageReader = MemoryReader(ck, step, folder, sources)
        else:
            reader = _storage_reader(ck, step, folder)
        _validate(stateful, reader.read_metadata(), strict, group, ck.world_size)
        try:
            dcp.load(stateful, storage_reader=reader, planner=planner, process_group=group)
        except CheckpointException as exc:  # raised on every rank, with every rank's failure
            if source == "memory":  # (memory was verified before: not a failed checksum)
                raise
            fallbacks.append(_failed_verification(ck, exc, step))
            step = _older_commit(ck, step, fallbacks, explicit)
            continue
        break
    if sources is not None:
        logger.warning("[RANK %d] resharded step %d from the memory of a job of %d ranks onto %d ranks",
                       ck.rank, step, sources.choice.world_size, ck.world_size)
    if source == "storage":  # once the files verified: an attempt continues what it loaded
        declare_resume(ck, step, source)
    logger.info("[RANK %d] loaded DCP step %d from %s in %.3fs", ck.rank, step, source, time.perf_counter() - started)
    return DcpLoadResult(step, source, fallbacks)


def _failed_verification(ck: Checkpointer, exc: CheckpointException, step: int) -> str:
    """What failed verification on which rank; ``exc`` itself when something else failed."""
    corrupt = {rank: failure[0] for rank, failure in exc.failures.items()
               if isinstance(failure[0], CorruptCheckpointError)}
    if not corrupt:
        raise exc
    return f"step {step}: " + "; ".join(f"rank {rank}: {error}" for rank, error in sorted(corrupt.items()))


def _older_commit(ck: Checkpointer, step: int, fallbacks: list[str], explicit: bool) -> int:
    """The committed step to read after ``step`` failed verification (every rank gets the same)."""
    older = [s for s in ck.committed_steps() if s < step]
    if explicit or not older:
        raise CorruptCheckpointError(
            f"committed DCP step {step} in {ck.url} failed verification ({fallbacks[-1]})"
            + ("" if explicit else "; no older commit is left: restore the file from a backup, or delete the step to "
               "start over"))
    logger.warning("[RANK %d] committed DCP step %d failed verification (%s); loading step %d instead", ck.rank,
                   step, fallbacks[-1], older[-1])
    return older[-1]


def _storage_reader(ck: Checkpointer, step: int, folder: str) -> StorageReader:
    """Committed ``step`` read through the checkpointer's storage, one pass per file (see ``_dcp_storage``)."""
    base = ck.committed_folder(step) or ck.layout.step_path(step)
    inner = folder.strip("/")
    return CommittedReader(ck.storage, f"{base}/{inner}" if inner else base, ck.committed_entries(step), inner)


def _validate(state: dict[str, Any], metadata: Metadata, strict: bool, group: Any, world_size: int) -> None:
    """Compare the flattened target with the checkpoint on every rank; raise everywhere if any rank differs."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    problems: list[str] = []
    if strict:
        flat, _ = flatten_state_dict(_stateful_to_state_dict(state))
        saved = metadata.state_dict_metadata
        missing = [k for k in flat if k not in saved]
        if missing:
            problems.append(f"missing from the checkpoint: {_some(missing)}")
        shapes = [
            f"{key} (checkpoint {tuple(saved[key].size)}, target {tuple(value.shape)})"
            for key, value in flat.items()
            if isinstance(value, torch.Tensor) and isinstance(saved.get(key), TensorStorageMetadata)
            and tuple(value.shape) != tuple(saved[key].size)
        ]
        if shapes:
            problems.append(f"shapes differ: {_some(shapes)}")
        if problems:
            prefixes = {k.split(".")[0] for k in flat}
            unexpected = [k for k in saved if k not in flat and k.split(".")[0] in prefixes]
            if unexpected:
                problems.append(f"in the checkpoint but not in the target: {_some(unexpected)}")
    views = collectives.all_gather_object(problems, world_size, group)
    by_text: dict[str, list[int]] = {}
    for rank, rank_problems in enumerate(views):
        if rank_problems:
            by_text.setdefault("; ".join(rank_problems), []).append(rank)
    if by_text:
        lines = " | ".join(f"ranks {ranks}: {text}" for text, ranks in by_text.items())
        raise LayoutMismatchError(f"the checkpoint does not match the state it is loaded into ({lines}). Load into a "
                                  "model of the same architecture, or pass strict=False to load the matching keys only")


def _some(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


class MemoryReader(ItemReader):
    """A DCP storage reader over the ranks' shared-memory snapshots of one step.

    Each rank reads the items of its own ``.distcp`` parts straight from its slot (no copy until
    the planner's target); items in other ranks' files are sent by their owners (one broadcast
    per owner) inside ``read_data``, which DCP calls on every rank.
    """

    def __init__(self, checkpointer: Checkpointer, step: int, folder: str, sources: reshard.Sources | None = None
                 ) -> None:
        super().__init__()
        self.ck = checkpointer
        self.folder = folder
        if sources is None:  # the same ranks: each serves its own snapshot
            snapshot = checkpointer.memory_snapshots().get(step)
            if snapshot is None:
                raise CheckpointNotFoundError(f"rank {checkpointer.rank} no longer holds step {step} in memory")
            snapshots, self.owners = {checkpointer.rank: snapshot}, None
        else:  # another number of ranks: each serves the old ranks' snapshots it was given
            snapshots, self.owners = sources.readable(), sources.choice.owners
        prefix = _join(folder, "")
        self.parts: dict[str, dict[int, Any]] = {}
        raw_metadata = None
        for old_rank, (slot, meta) in snapshots.items():
            for fmeta in meta["files"]:
                path = fmeta["path"]
                if not path.startswith(prefix) or "/" in path[len(prefix):]:
                    continue
                name = path[len(prefix):]
                if name == METADATA_FILE:
                    if old_rank == 0:
                        raw_metadata = decode_from_slot(slot, meta["regions"], fmeta)
                elif fmeta["codec"] == Codec.PARTS.value:
                    parts = decode_from_slot(slot, meta["regions"], fmeta, copy=False)
                    self.parts[name] = {offset: part for part, (offset, _) in zip(parts, parts_layout(parts))}
        raw_metadata = broadcast_bytes(raw_metadata, checkpointer, src=self._owner(0))
        if raw_metadata is None:
            raise CheckpointNotFoundError(f"the memory snapshot of step {step} holds no {_join(folder, METADATA_FILE)}")
        self.metadata: Metadata = pickle.loads(raw_metadata)
        self.storage_data: dict[Any, Any] = self.metadata.storage_data

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def read_data(self, plan: Any, planner: Any) -> Future:
        received = self._exchange(plan)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            key = (info.relative_path, info.offset)
            part = received[key] if key in received else self.parts[info.relative_path][info.offset]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(part)))
                continue
            if not isinstance(part, torch.Tensor):
                part = torch.load(io.BytesIO(part), map_location="cpu", weights_only=True)
            commit_item(part, req, planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _exchange(self, plan: Any) -> dict[tuple[str, int], bytes]:
        """Fetch the items this rank needs from other ranks' slots (collective)."""
        wanted = sorted({
            (info.relative_path, info.offset, info.length)
            for info in (self.storage_data[req.storage_index] for req in plan.items)
            if info.relative_path not in self.parts
        })
        requests = collectives.all_gather_object(wanted, self.ck.world_size, self.ck.process_group)
        by_owner: dict[int, list[tuple[str, int, int]]] = {}
        for path, offset, length in sorted({tuple(r) for rank_requests in requests for r in rank_requests}):
            match = _FILE_RANK.search(path)
            if match is None:
                raise FlashCkptError(f"cannot tell which rank wrote {path!r}; load from storage (prefer_memory=False)")
            by_owner.setdefault(self._owner(int(match.group(1))), []).append((path, offset, length))
        received: dict[tuple[str, int], bytes] = {}
        mine = set((p, o) for p, o, _ in wanted)
        for owner in range(self.ck.world_size):
            items = by_owner.get(owner)
            if not items:
                continue
            payload = self._encode(items) if owner == self.ck.rank else None
            data = broadcast_bytes(payload, self.ck, src=owner)
            position = 0
            for path, offset, length in items:
                if (path, offset) in mine:
                    received[(path, offset)] = data[position:position + length]
                position += length
        return received

    def _owner(self, old_rank: int) -> int:
        """The rank that serves the snapshot of ``old_rank`` (the same rank, unless resharding)."""
        return old_rank if self.owners is None else self.owners[old_rank]

    def _encode(self, items: list[tuple[str, int, int]]) -> bytes:
        out = io.BytesIO()
        for path, offset, length in items:
            part = self.parts[path][offset]
            start = out.tell()
            if isinstance(part, torch.Tensor):
                torch.save(part, out)
            else:
                out.write(part)
            if out.tell() - start != length:
                raise FlashCkptError(f"{path}@{offset}: item is {out.tell() - start} bytes in memory, "
                                     f"{length} in the metadata; load from storage (prefer_memory=False)")
        return out.getvalue()
