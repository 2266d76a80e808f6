r"""Flash checkpoints for Megatron-LM: one import and one call, and ``save_checkpoint`` /
``load_checkpoint`` go through shared memory and the node's saver, in Megatron's own layout.

```python
from flashckpt_integrations.adapters import megatron as flash_megatron

flash = flash_megatron.patch(persist_interval=100)   # on every rank, before pretrain() or your loop
...                                                  # --save-interval 10: memory every 10 iterations,
flash.close()                                        # storage every 100; close(): wait, free memory
```

* ``megatron.training.checkpointing.save_checkpoint`` (and every module that imported it, such as
  ``megatron.training.training``) runs Megatron's own code to build each rank's state, and the
  call returns once the state is in the rank's shared-memory slot; the node's saver writes the
  files Megatron would have written:

  - ``--ckpt-format torch_dist`` (Megatron's default): the sharded state dict of Megatron's
    ``generate_state_dict`` (the distributed optimizer's in the format Megatron picks,
    ``--ckpt-fully-parallel-save`` spreading the replicated shards over the data-parallel ranks
    as Megatron's own wrapper does) is planned by megatron-core's planner and becomes
    ``iter_XXXXXXX/__<rank>_0.distcp``, ``.metadata`` and ``metadata.json``;
  - ``--ckpt-format torch``: ``iter_XXXXXXX/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt`` and the
    distributed optimizer's ``distrib_optim.pt``, byte-compatible with ``torch.save``.

  The committer renames the iteration's folder into place and writes
  ``latest_checkpointed_iteration.txt`` only once every rank's files are durable, so unpatched
  Megatron reads the result and never sees a partial iteration. ``--async-save`` (with or
  without ``--use-persistent-ckpt-worker``) overlaps the copy into shared memory with the next
  iteration (``async_snapshot``, unless a config dict sets it to False): the torch
  optimizers inside Megatron's wait for the copy before they change the parameters. The saver
  is the asynchronous writer, so Megatron's worker is not started and no second copy is made
  (one INFO line says so).
* Saves whose iteration is not a multiple of ``persist_interval``, and Megatron's non-persistent
  saves (``--non-persistent-save-interval``), stay in memory only: one memory copy, and they
  survive the death of the training processes.
* ``load_checkpoint`` loads the newest iteration that every rank holds complete in memory, when
  it is at least as new as the newest commit and was saved in the same format with the same
  parallel sizes: ``torch_dist`` shards are read by a ``dist_checkpointing.load`` strategy
  straight from the slots (and from other ranks' slots, for the shards they saved); ``torch``
  files that only another rank's slot holds are sent over a gloo group. A ``torch_dist`` job
  relaunched with another number of ranks on the same nodes (fewer data-parallel ranks after a
  lost node, say) reads the newest iteration that the old job's ranks all left in the nodes'
  memory (their slots and peer replicas, :mod:`..core.reshard`), when it is at least as new as
  the newest commit: Megatron's own load code reshards it as it reshards a commit, and the old
  ranks' shards reach the new ranks from the ranks that hold them. Else Megatron's own code
  loads the newest commit from storage: a ``torch_dist`` one with any tensor, pipeline, data or
  expert parallel sizes; a ``torch`` one saved with other sizes fails up front with the sizes that
  differ.
* Configurations outside this (other ``--ckpt-format``\ s, release checkpoints, explicit rank
  overrides, the layer-wise distributed optimizer, ``--verify-integrity`` with ``torch_dist``)
  use Megatron's stock code, with a warning. For ``dist_checkpointing.save`` without
  ``megatron.training`` see :mod:`.megatron_core`.

Supported: Megatron-LM's ``megatron.training`` as shipped with megatron-core 0.19 (Python >= 3.12).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..config import CheckpointerConfig
from ..core import collectives, reshard
from ..core.checkpointer import Checkpointer
from ..core.layout import Layout
from ..core.results import PersistResult, SaveResult
from ..core.state import Codec, FileSpec
from ..errors import FlashCkptError, LayoutMismatchError, missing_dependency
from ._common import declare_resume, log_save, newest_memory_step
from ._transfer import exchange, gloo_group

try:
    from megatron.core import mpu
    from megatron.core import package_info as _package_info
    from megatron.core.dist_checkpointing import serialization as _serialization
    from megatron.core.dist_checkpointing.strategies import torch as _torch_strategies
    from megatron.core.optimizer import distrib_optimizer as _distrib_optimizer
    from megatron.training import checkpointing as _checkpointing
    from megatron.training import initialize as _initialize
    from megatron.training.global_vars import get_args
except ImportError as exc:  # pragma: no cover - exercised only without megatron
    raise missing_dependency(
        "megatron.training (Megatron-LM's training package, shipped with megatron-core 0.19 on Python >= 3.12; "
        "with an older megatron-core, dist_checkpointing.save works through "
        "flashckpt_integrations.adapters.megatron_core.FlashTorchDistSaveStrategy)", "megatron") from exc

from . import megatron_core as _dist  # noqa: E402  (after the megatron.training check: its message first)

logger = logging.getLogger(__name__)

__all__ = ["LAYOUT", "SUPPORTED_VERSIONS", "MegatronFlash", "patch", "unpatch"]

SUPPORTED_VERSIONS = ("0.19",)
"""megatron-core release lines whose ``megatron.training.checkpointing`` this patch was built against."""
TRACKER = "latest_checkpointed_iteration.txt"
LAYOUT = Layout(step_dir="iter_{step:07d}", tracker=TRACKER, tracker_content="{step}", staging=True)
"""Megatron's ``iter_XXXXXXX/`` folders and tracker; the folder appears at commit."""
_SIZES = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "expert_model_parallel_size": "ep", "context_parallel_size": "cp", "data_parallel_size": "dp",
    "world_size": "world",
}
_FILE_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")
"""The sizes that name a legacy checkpoint's files: a load with other values cannot find them."""
FORMATS = ("torch_dist", "torch")
"""The ``--ckpt-format`` values the patch saves and loads itself."""
_ASYNC_NOTE = ("flashckpt: under the flash patch, --async-save overlaps the copy into shared memory with the next "
               "iteration (the optimizers wait for it before changing the parameters) and the node's saver "
               "writes the files in the background, so Megatron's checkpoint worker is not started "
               "(no second copy)")

_active: MegatronFlash | None = None


class _TorchProxy(types.ModuleType):
    """``torch`` as Megatron's checkpointing modules see it while patched.

    ``save`` of a path inside the iteration being saved is captured for the snapshot, and ``load``
    of a path inside the iteration being served from memory returns the snapshot's object;
    everything else is torch itself.
    """

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        io = _active._io if _active is not None else None
        if io is not None and io.capture(obj, f):
            return None
        return torch.save(obj, f, *args, **kwargs)

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        io = _active._io if _active is not None else None
        if io is not None and (found := io.serve(f)) is not None:
            return found
        return torch.load(f, *args, **kwargs)


class _Files:
    """The files of one iteration, captured from a save or served to a load (absolute paths)."""

    def __init__(self, step_dir: str, served: Mapping[str, Any] | None = None) -> None:
        self.step_dir = step_dir
        self.files: dict[str, Any] = dict(served or {})
        self.serving = served is not None

    def _inside(self, f: Any) -> str | None:
        if not isinstance(f, (str, os.PathLike)):
            return None
        path = os.path.abspath(os.fspath(f))
        return path if path.startswith(self.step_dir + os.sep) else None

    def capture(self, obj: Any, f: Any) -> bool:
        path = None if self.serving else self._inside(f)
        if path is not None:
            self.files[path] = obj
        return path is not None

    def serve(self, f: Any) -> Any:
        path = self._inside(f) if self.serving else None
        return self.files.pop(path, None) if path is not None else None


@dataclasses.dataclass
class MegatronFlash:
    """What :func:`patch` installed: the checkpointers (one per checkpoint directory) and the outcomes.

    ``last_save`` is the :class:`~flashckpt_integrations.SaveResult` of the newest save, and
    ``last_load`` is ``(iteration, "memory" | "storage")`` of the newest load (``None``: nothing
    was loaded).
    """

    persist_interval: int | None = 1
    config: CheckpointerConfig = dataclasses.field(default_factory=lambda: CheckpointerConfig(layout=LAYOUT))
    last_save: SaveResult | None = None
    last_load: tuple[int, str] | None = None
    _checkpointers: dict[str, Checkpointer] = dataclasses.field(default_factory=dict)
    _io: _Files | None = None
    _originals: dict[str, Any] = dataclasses.field(default_factory=dict)
    _replaced: list[tuple[Any, str, Any]] = dataclasses.field(default_factory=list)
    _warned: set[str] = dataclasses.field(default_factory=set)
    _attached: set[int] = dataclasses.field(default_factory=set)
    _transfer_group: Any = None
    _follow_async_save: bool = True  # --async-save turns on async_snapshot (the config did not set it)

    def checkpointer(self, directory: str | os.PathLike) -> Checkpointer:
        """The checkpointer of a checkpoint directory (``--save`` / ``--load``), made on first use."""
        root = os.path.abspath(os.fspath(directory))
        if root not in self._checkpointers:
            self._checkpointers[root] = Checkpointer(root, self.config)
        return self._checkpointers[root]

    def wait_for_snapshot(self) -> str | None:
        """Wait until the overlapped copies into shared memory (``--async-save``) are done: only then
        would a crash resume from the newest save. ``None``, or the first copy's failure."""
        errors = [ck.wait_for_snapshot() for ck in self._checkpointers.values()]
        return next((e for e in errors if e is not None), None)

    def wait(self) -> PersistResult | None:
        """Wait until every persisting save is committed (or failed); the newest outcome."""
        outcomes = [ck.wait() for ck in self._checkpointers.values()]
        return next((o for o in reversed(outcomes) if o is not None), None)

    def close(self) -> None:
        """Wait for in-flight persisting and free the shared memory (the end of a normal run)."""
        for ck in self._checkpointers.values():
            ck.close()
        self._checkpointers.clear()

    # --- save ------------------------------------------------------------------------------

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        original = self._originals["save_checkpoint"]
        call = inspect.signature(original).bind(*args, **kwargs)
        margs = get_args()
        reason = _unsupported_save(margs, call.arguments)
        if reason is not None:
            self._warn(reason)
            return original(*args, **kwargs)
        iteration = int(call.arguments["iteration"])
        memory_only = bool(call.arguments.pop("non_persistent_ckpt", False))
        persist = not memory_only and self.persist_interval is not None and iteration % self.persist_interval == 0
        if margs.async_save:
            self._note_async()
        ck = self.checkpointer(margs.save)
        overlap = ck.config.async_snapshot or bool(margs.async_save and self._follow_async_save)
        self._attach(ck, call.arguments.get("optimizer"), overlap)
        capture = self._capture_dist if margs.ckpt_format == "torch_dist" else self._capture
        files = capture(ck, iteration, original, call)
        self.last_save = ck.save(iteration, files=files, persist=persist, async_snapshot=overlap,
                                 metadata={"megatron": _snapshot_kind(margs)})
        log_save(logger, ck.rank, "Megatron save_checkpoint", self.last_save,
                 os.path.join(ck.url, LAYOUT.step_path(iteration)), time.perf_counter() - started)

    def _attach(self, ck: Checkpointer, optimizer: Any, overlap: bool) -> None:
        """With an overlapped copy, make the torch optimizers inside Megatron's wait for it."""
        if not overlap or optimizer is None or id(optimizer) in self._attached:
            return
        self._attached.add(id(optimizer))
        for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            inner = getattr(part, "optimizer", None)
            if isinstance(inner, torch.optim.Optimizer):
                ck.attach_optimizer(inner)

    def _capture(self, ck: Checkpointer, iteration: int, original: Any, call: inspect.BoundArguments) -> dict[str, Any]:
        """Run Megatron's save with its file writes captured; the files relative to the iteration's folder."""
        step_dir = os.path.join(ck.url, LAYOUT.step_path(iteration))
        margs = get_args()
        scratch = tempfile.mkdtemp(prefix="flashckpt-megatron-")
        try:
            with self._io_of(_Files(step_dir)) as io, _swapped(
                _checkpointing,
                ensure_directory_exists=_skip_inside(step_dir, _checkpointing.ensure_directory_exists),
                get_checkpoint_tracker_filename=lambda _: os.path.join(scratch, TRACKER),  # the committer writes it
            ), _swapped(margs, async_save=False):  # the saver is the asynchronous part
                original(*call.args, **call.kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {os.path.relpath(path, step_dir).replace(os.sep, "/"): obj for path, obj in io.files.items()}

    def _capture_dist(self, ck: Checkpointer, iteration: int, original: Any,
                      call: inspect.BoundArguments) -> dict[str, Any]:
        """Run Megatron's ``torch_dist`` save with the shards planned into files instead of written.

        Megatron builds the sharded state, wraps the strategy for ``--ckpt-fully-parallel-save``
        and calls ``dist_checkpointing.save``; the iteration's folder is a scratch one, where
        Megatron writes its small files (``metadata.json``), taken as they are.
        """
        margs = get_args()
        step_dir = os.path.join(ck.url, LAYOUT.step_path(iteration))
        scratch = tempfile.mkdtemp(prefix="flashckpt-megatron-")
        stand_in = os.path.join(scratch, LAYOUT.step_path(iteration))
        strategy = _dist.PlanningSaveStrategy()
        context = call.arguments.get("checkpointing_context")
        held = context.pop("save_strategy", None) if isinstance(context, dict) else None  # a stock one from before
        try:
            with _swapped(
                _checkpointing,
                TorchDistSaveShardedStrategy=lambda *_, **__: strategy,
                get_checkpoint_name=_moved(step_dir, stand_in, _checkpointing.get_checkpoint_name),
                get_checkpoint_tracker_filename=lambda _: os.path.join(scratch, TRACKER),  # the committer writes it
            ), _swapped(margs, async_save=False):
                original(*call.args, **call.kwargs)
            files: dict[str, Any] = dict(strategy.files)
            for root, _, names in os.walk(stand_in):
                for name in names:
                    path = os.path.join(root, name)
                    with open(path, "rb") as f:
                        files[os.path.relpath(path, stand_in).replace(os.sep, "/")] = FileSpec(f.read(), Codec.BYTES)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            if isinstance(context, dict):
                context.pop("save_strategy", None)
                if held is not None:
                    context["save_strategy"] = held
        return files

    def _note_async(self) -> None:
        if "async" not in self._warned:
            self._warned.add("async")
            logger.info(_ASYNC_NOTE)

    # --- load ------------------------------------------------------------------------------

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["load_checkpoint"]
        call = inspect.signature(original).bind(*args, **kwargs)
        call.apply_defaults()
        margs = get_args()
        load_dir = getattr(margs, call.arguments["load_arg"], None)
        reason = _unsupported_load(margs, load_dir)
        if reason is not None:
            self._warn(reason)
            return original(*args, **kwargs)
        ck = self.checkpointer(load_dir)
        kind = _snapshot_kind(margs)
        step, sources = self._memory_step(ck, kind), None
        if step is None:  # a job of another number of ranks may have left a newer iteration in memory
            sources = _resharding_sources(ck, kind)
        if step is None and sources is None:
            if margs.ckpt_format == "torch":  # torch_dist checkpoints reshard on load
                _check_storage_layout(margs, load_dir)
            result = original(*args, **kwargs)
            iteration = result[0] if isinstance(result, tuple) else result
            self.last_load = (int(iteration), "storage") if iteration else None
            if iteration and margs.save and os.path.abspath(margs.save) == os.path.abspath(load_dir):
                declare_resume(ck, int(iteration))  # Megatron's own loader read it: saves continue its lineage
            return result
        context = call.arguments.get("checkpointing_context")
        try:
            if sources is not None:
                step = sources.choice.step
                with self._serving_dist(ck, step, load_dir, context, sources=sources):
                    result = original(*args, **kwargs)
            else:
                serving = self._serving_dist if margs.ckpt_format == "torch_dist" else self._serving
                with serving(ck, step, load_dir, context):
                    result = original(*args, **kwargs)
        finally:
            if sources is not None:
                sources.close()
        self.last_load = (step, "memory")
        if sources is None:
            logger.warning("[RANK %d] flashckpt: resumed iteration %d from shared memory", ck.rank, step)
        else:
            logger.warning("[RANK %d] flashckpt: resumed iteration %d from the shared memory of a job of %d ranks, "
                           "resharded onto %d ranks (%s)", ck.rank, step, sources.choice.world_size, ck.world_size,
                           _sizes_text(kind))
        return result

    def _memory_step(self, ck: Checkpointer, sizes: dict[str, Any]) -> int | None:
        """The iteration to load from memory (collective): held complete by every rank, saved in
        this run's format with its parallel sizes, and at least as new as the newest commit; else None."""
        matching, other = [], {}
        ck.recover_replicas()  # a rank whose node lost its memory fetches the iteration from a peer's replica
        for step, (_, meta) in ck.memory_snapshots().items():
            saved = meta.get("user", {}).get("megatron")
            if saved == sizes:
                matching.append(step)
            else:
                other[step] = saved
        step = newest_memory_step(ck, matching)
        if step is None and other:
            committed = ck.committed_steps()
            skipped = [s for s in other if not committed or s >= committed[-1]]
            if skipped:
                logger.warning("[RANK %d] flashckpt: the memory snapshots of iterations %s were saved with format "
                               "and parallel sizes %s, this run has %s; loading from storage", ck.rank, sorted(skipped),
                               other[max(skipped)], sizes)
        return step

    @contextlib.contextmanager
    def _serving(self, ck: Checkpointer, step: int, load_dir: str, context: Any = None) -> Iterator[None]:
        """Let Megatron's stock load code read iteration ``step`` (``torch`` files) from the ranks' memory snapshots."""
        result = ck.load(step, map_location="cpu")
        if result is None or result.source != "memory":
            raise FlashCkptError(f"the memory snapshot of iteration {step} vanished while it was being loaded")
        step_dir = os.path.join(ck.url, LAYOUT.step_path(step))
        own = {os.path.join(step_dir, rel): obj for rel, obj in result.files.items()}
        if self._transfer_group is None:
            self._transfer_group = gloo_group()
        served = {**own, **exchange(own, _needed_files(get_args(), ck.url, step), ck.rank, ck.world_size,
                                    ck.process_group, self._transfer_group)}
        scratch = tempfile.mkdtemp(prefix="flashckpt-megatron-")
        tracker = os.path.join(scratch, TRACKER)
        with open(tracker, "w") as f:
            f.write(str(step))
        try:
            with self._io_of(_Files(step_dir, served)), _swapped(
                _checkpointing,
                get_checkpoint_tracker_filename=_tracker_of(load_dir, tracker,
                                                            _checkpointing.get_checkpoint_tracker_filename),
                _get_checkpoint_format=_format_of(step_dir, _checkpointing._get_checkpoint_format),
            ):
                yield
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    @contextlib.contextmanager
    def _serving_dist(self, ck: Checkpointer, step: int, load_dir: str, context: Any = None,
                      sources: reshard.Sources | None = None) -> Iterator[None]:
        """Let Megatron's stock load code read ``torch_dist`` iteration ``step`` from the ranks' memory snapshots.

        Megatron finds a stand-in folder with the tracker and rank 0's small files
        (``metadata.json``); the common state and the shards come from a
        :class:`~.megatron_core.SnapshotReader` (collective), through
        :class:`~.megatron_core.FlashTorchDistLoadShardedStrategy` in place of Megatron's strategy.
        ``sources``: the snapshots of a job of another number of ranks to read instead of this
        job's own (Megatron reshards them as it reshards a checkpoint on storage).
        """
        # read here, not by ck.load(): saves continue its lineage (the old job's, when resharding)
        declare_resume(ck, step, "memory", tag=sources.tag if sources is not None else None)
        reader = _dist.SnapshotReader(ck, step, sources)
        if reader.elsewhere and ck.rank == 0:
            logger.warning("[RANK %d] flashckpt: iteration %d is resumed from memory without the files %s, which "
                           "only other ranks' snapshots hold (Megatron's load does not read them; they are in the "
                           "iteration's folder only once it is committed to storage)", ck.rank, step,
                           ", ".join(reader.elsewhere))
        step_dir = os.path.join(ck.url, LAYOUT.step_path(step))
        scratch = tempfile.mkdtemp(prefix="flashckpt-megatron-")
        stand_in = os.path.join(scratch, LAYOUT.step_path(step))
        os.makedirs(stand_in)
        for rel, data in reader.files.items():
            path = os.path.join(stand_in, *rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        tracker = os.path.join(scratch, TRACKER)
        with open(tracker, "w") as f:
            f.write(str(step))
        held = context.get("load_strategy") if isinstance(context, dict) else None
        try:
            with _swapped(
                _checkpointing,
                get_checkpoint_tracker_filename=_tracker_of(load_dir, tracker,
                                                            _checkpointing.get_checkpoint_tracker_filename),
                get_checkpoint_name=_moved(step_dir, stand_in, _checkpointing.get_checkpoint_name),
                TorchDistLoadShardedStrategy=functools.partial(_dist.FlashTorchDistLoadShardedStrategy, reader),
            ), _dist.reading_from(reader, checkpoint_dir=stand_in):
                yield
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            if isinstance(context, dict):  # Megatron keeps its load strategy: not one that reads this snapshot
                context.pop("load_strategy", None)
                if held is not None:
                    context["load_strategy"] = held

    # --- patching ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _io_of(self, files: _Files) -> Iterator[_Files]:
        self._io = files
        try:
            yield files
        finally:
            self._io = None

    def _install(self) -> None:
        for name in ("save_checkpoint", "load_checkpoint"):
            original = getattr(_checkpointing, name)
            self._originals[name] = original
            wrapper = functools.update_wrapper(_forwarding(getattr(self, name)), original)
            for module in list(sys.modules.values()):  # `from ...checkpointing import save_checkpoint` too
                if getattr(module, name, None) is original:
                    self._replaced.append((module, name, original))
                    setattr(module, name, wrapper)
        proxy = _TorchProxy()
        for module in (_checkpointing, _distrib_optimizer):
            self._replaced.append((module, "torch", module.torch))
            module.torch = proxy
        # --async-save --use-persistent-ckpt-worker: initialize_megatron() would start Megatron's worker
        self._replaced.append((_initialize, "init_persistent_async_worker", _initialize.init_persistent_async_worker))
        _initialize.init_persistent_async_worker = lambda *_, **__: self._note_async()

    def _uninstall(self) -> None:
        for module, name, original in reversed(self._replaced):
            setattr(module, name, original)
        self._replaced.clear()

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("flashckpt: %s is not supported by the Megatron patch; Megatron's stock checkpointing "
                           "is used (no shared memory, no background saving)", reason)


def patch(*, persist_interval: int | None = 1,
          config: CheckpointerConfig | Mapping[str, Any] | None = None) -> MegatronFlash:
    """Route Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` through flash checkpoints (every rank).

    ``persist_interval``: iterations that are a multiple of it are persisted, the others stay in
    memory only (``None``: persist none; ``1``: persist every save). ``config``: a
    :class:`~flashckpt_integrations.CheckpointerConfig` or a dict of its fields (``retention``,
    ``async_snapshot``, ...); the layout is always Megatron's. With ``{"async_snapshot": True}``
    (or, when the config leaves it unset, Megatron's ``--async-save``) the copy into shared
    memory overlaps the next iteration's forward and backward passes, and the torch optimizers
    inside Megatron's wait for it before they change the parameters; a dict with
    ``{"async_snapshot": False}`` keeps the copy synchronous whatever the flags say.
    """
    global _active
    _check_version()
    if persist_interval is not None and (isinstance(persist_interval, bool) or not isinstance(persist_interval, int)
                                         or persist_interval < 1):
        raise ValueError(f"persist_interval={persist_interval!r} must be a positive number of iterations or None")
    if _active is not None:
        raise FlashCkptError("Megatron is patched already; call flash_megatron.unpatch() before patching again")
    follow = not (isinstance(config, Mapping) and "async_snapshot" in config)  # a dict can say False
    if isinstance(config, CheckpointerConfig):
        fields = dataclasses.asdict(config)
    elif config is None or isinstance(config, Mapping):
        fields = dict(config or {})
        if "layout" in fields:
            raise ValueError("config must not set 'layout': the patch writes Megatron's own iter_XXXXXXX folders")
    else:
        raise TypeError(f"config must be a CheckpointerConfig or a dict of its fields, got {type(config)}")
    fields["layout"] = LAYOUT
    flash = MegatronFlash(persist_interval=persist_interval, config=CheckpointerConfig(**fields),
                          _follow_async_save=follow)
    flash._install()
    _active = flash
    return flash


def unpatch(*, close: bool = True) -> None:
    """Restore Megatron's stock functions; with ``close`` wait for persisting and free the memory."""
    global _active
    flash, _active = _active, None
    if flash is not None:
        flash._uninstall()
        if close:
            flash.close()


# --- helpers ---------------------------------------------------------------------------------


def _check_version() -> None:
    version = getattr(_package_info, "__version__", "unknown")
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VERSIONS):
        raise FlashCkptError(
            f"megatron-core {version} is not supported by the Megatron patch; supported releases: "
            f"{', '.join(v + '.x' for v in SUPPORTED_VERSIONS)} (the ones that ship megatron.training). Install one of "
            "them (pip install 'megatron-core==0.19.*'), or keep Megatron's stock checkpointing; with this release, "
            "dist_checkpointing.save can still go through shared memory with "
            "flashckpt_integrations.adapters.megatron_core.FlashTorchDistSaveStrategy."
        )
    needed = [(_checkpointing, name) for name in (
        "save_checkpoint", "load_checkpoint", "get_checkpoint_name", "_get_checkpoint_format",
        "get_checkpoint_tracker_filename", "ensure_directory_exists", "find_checkpoint_rank_0",
        "TorchDistSaveShardedStrategy", "TorchDistLoadShardedStrategy")]
    needed += [(_initialize, "init_persistent_async_worker"), (_serialization, "_get_filesystem_reader"),
               (_torch_strategies, "_get_filesystem_reader")]
    for module, name in needed:
        if not callable(getattr(module, name, None)):
            raise FlashCkptError(f"{module.__name__} has no {name}(); this Megatron-LM build is not one the patch "
                                 f"supports ({', '.join(SUPPORTED_VERSIONS)})")


def _unsupported_save(margs: Any, arguments: Mapping[str, Any]) -> str | None:
    if margs.save is None:
        return "saving without --save"
    if margs.ckpt_format not in FORMATS:
        return f"--ckpt-format {margs.ckpt_format}"
    if margs.ckpt_format == "torch_dist" and getattr(margs, "verify_integrity", False):
        return "--verify-integrity (its manifest hashes files that the saver writes later)"
    if arguments.get("release"):
        return "a release checkpoint"
    if any(arguments.get(k) is not None for k in ("pipeline_rank", "expert_rank", "tensor_rank", "pipeline_parallel",
                                                  "expert_parallel")):
        return "save_checkpoint with explicit rank overrides"
    if getattr(margs, "use_layer_wise_distributed_optimizer", False):
        return "the layer-wise distributed optimizer"
    return None


def _unsupported_load(margs: Any, load_dir: str | None) -> str | None:
    if load_dir is None:
        return "loading without --load"
    if margs.ckpt_format not in FORMATS:
        return f"--ckpt-format {margs.ckpt_format}"
    if margs.ckpt_format == "torch_dist" and getattr(margs, "verify_integrity", False):
        return "--verify-integrity"
    if getattr(margs, "use_layer_wise_distributed_optimizer", False):
        return "the layer-wise distributed optimizer"
    if getattr(margs, "ckpt_step", None) or getattr(margs, "finetune", False):
        return "--ckpt-step / --finetune"
    return None


def _parallel_sizes(margs: Any) -> dict[str, int]:
    return {short: int(getattr(margs, name, 1) or 1) for name, short in _SIZES.items()}


def _snapshot_kind(margs: Any) -> dict[str, Any]:
    """What a memory snapshot records about its save, and what a load from it must match."""
    return {**_parallel_sizes(margs), "format": margs.ckpt_format}


def _sizes_text(kind: Mapping[str, Any]) -> str:
    return ", ".join(f"{name} {kind[name]}" for name in ("tp", "pp", "ep", "cp", "dp") if name in kind)


def _resharding_sources(ck: Checkpointer, kind: Mapping[str, Any]) -> reshard.Sources | None:
    """The ``torch_dist`` snapshots that a job of another number of ranks left in this node's memory,
    of an iteration at least as new as the newest commit (collective; the same answer on every
    rank), or None. Megatron's load reshards them as it reshards a commit (any tensor, pipeline,
    data and expert parallel sizes). A newer iteration in memory that cannot be resumed (saved
    with ``--ckpt-format torch``, or not every old rank's snapshot of it is here) is named in a
    WARNING, as Megatron then loads an older commit from storage."""
    committed = ck.committed_steps()
    newest_commit = collectives.all_gather_object(committed[-1] if committed else None, ck.world_size,
                                                  ck.process_group)[0]  # rank 0's view, the same on every rank
    sources = reshard.open_sources(ck, newest_commit) if kind["format"] == "torch_dist" else None
    if sources is not None:
        served = [[old, (meta.get("user") or {}).get("megatron")] for old, (_, meta) in sources.slots.items()]
        saved = dict(entry for view in collectives.all_gather_object(served, ck.world_size, ck.process_group)
                     for entry in view)
        formats = sorted({str((kind_of or {}).get("format")) for kind_of in saved.values()})
        if formats == ["torch_dist"]:
            logger.info("[RANK %d] flashckpt: resharding iteration %d from the memory of a job of %d ranks (%s) onto "
                        "%d ranks (%s)", ck.rank, sources.choice.step, sources.choice.world_size,
                        _sizes_text(saved[0]), ck.world_size, _sizes_text(kind))
            return sources
        newer: tuple[int, int] | None = (sources.choice.step, sources.choice.world_size)
        reason = f"it was saved with --ckpt-format {'/'.join(formats)}, which is not resharded from memory"
        sources.close()
    else:
        newer = reshard.newest_elsewhere(ck)
        if newer is None or (newest_commit is not None and newer[0] <= newest_commit):
            return None
        reason = ("--ckpt-format torch is not resharded from memory" if kind["format"] == "torch" else
                  "not every old rank's snapshot of it is in this node's memory, or one failed verification")
    if ck.rank == 0:
        logger.warning("[RANK %d] flashckpt: iteration %d is in this node's memory, saved by a job of %d ranks, but "
                       "this job of %d ranks cannot resume from it (%s); Megatron loads the newest commit (%s) from "
                       "storage instead. Relaunch with %d ranks to resume from memory.", ck.rank, newer[0], newer[1],
                       ck.world_size, reason, newest_commit, newer[1])
    return None


def _needed_files(margs: Any, root: str, step: int) -> list[str]:
    """The files Megatron's legacy load reads on this rank (absolute paths)."""
    model = os.path.abspath(_checkpointing.get_checkpoint_name(root, step))
    needed = [model]
    if margs.use_distributed_optimizer and not margs.no_load_optim and mpu.get_data_parallel_rank() == 0:
        needed.append(_checkpointing.get_distributed_optimizer_checkpoint_name(model))
    return needed


def _check_storage_layout(margs: Any, load_dir: str) -> None:
    """Fail before Megatron does (with a missing file or an assert) when the saved sizes differ."""
    tracker = _checkpointing.get_checkpoint_tracker_filename(load_dir)
    try:
        with open(tracker) as f:
            iteration = int(f.read().strip())
    except (OSError, ValueError):
        return  # no checkpoint, or a release one: Megatron's code decides
    path = _checkpointing.find_checkpoint_rank_0(load_dir, iteration)
    if path is None or os.path.isdir(path):
        return  # a torch_dist checkpoint (--auto-detect-ckpt-format): it reshards on load
    state = torch.load(path, map_location="cpu", mmap=True)
    saved = state.get("args") if isinstance(state, dict) else None
    if saved is None:
        return
    differ = [f"{name} {getattr(saved, name, 1)} (this run {getattr(margs, name, 1)})" for name in _FILE_SIZES
              if int(getattr(saved, name, 1) or 1) != int(getattr(margs, name, 1) or 1)]
    if differ:
        raise LayoutMismatchError(
            f"iteration {iteration} in {load_dir} was saved with other parallel sizes: {', '.join(differ)}. The torch "
            "checkpoint format stores one file per model-parallel rank and cannot be resharded on load: relaunch "
            "with the saved sizes, or convert the checkpoint with Megatron's checkpoint converter first."
        )


def _forwarding(method: Any) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)
    return forward


def _skip_inside(step_dir: str, ensure: Any) -> Any:
    def ensure_directory_exists(filename: str, check_parent: bool = True) -> None:
        if not os.path.abspath(filename).startswith(step_dir + os.sep):  # the saver makes the iteration's folders
            ensure(filename, check_parent)
    return ensure_directory_exists


def _moved(step_dir: str, stand_in: str, name_of: Any) -> Any:
    """``get_checkpoint_name`` with the paths inside ``step_dir`` moved into ``stand_in``."""
    def get_checkpoint_name(*args: Any, **kwargs: Any) -> str:
        path = name_of(*args, **kwargs)
        absolute = os.path.abspath(path)
        if absolute == step_dir or absolute.startswith(step_dir + os.sep):
            return stand_in + absolute[len(step_dir):]
        return path
    return get_checkpoint_name


def _tracker_of(load_dir: str, tracker: str, stock: Any) -> Any:
    """``get_checkpoint_tracker_filename`` answering ``tracker`` for ``load_dir`` (only)."""
    root = os.path.abspath(load_dir)

    def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
        return tracker if os.path.abspath(checkpoints_path) == root else stock(checkpoints_path)
    return get_checkpoint_tracker_filename


def _format_of(step_dir: str, detect: Any) -> Any:
    def get_checkpoint_format(checkpoint_name: str, args: Any) -> str:
        return "torch" if os.path.abspath(checkpoint_name) == step_dir else detect(checkpoint_name, args)
    return get_checkpoint_format


@contextlib.contextmanager
def _swapped(module: Any, **attributes: Any) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in attributes}
    for name, value in attributes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
