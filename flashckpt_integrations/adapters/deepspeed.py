"""Flash checkpoints for DeepSpeed, on DeepSpeed's own checkpoint-engine interface.

```python
import deepspeed
from flashckpt_integrations.adapters import deepspeed as flash_ds

engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
flash = flash_ds.enable(engine, "ckpt", persist_interval=10)   # on every rank
engine.load_checkpoint("ckpt")            # newest of: complete memory snapshot, committed checkpoint
for step in ...:
    ...
    engine.save_checkpoint("ckpt")        # memory snapshot; every 10th step also persisted
flash.close()                             # wait for in-flight persisting, free the shared memory
```

* ``engine.save_checkpoint(dir)`` copies what DeepSpeed saves into shared memory and returns. The
  node's saver writes DeepSpeed's own layout, ZeRO stages 0-3: ``global_stepN/mp_rank_00_model_states.pt``
  (ZeRO-3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``), ``*_optim_states.pt``, ``zero_to_fp32.py``.
  ``latest`` is written by the committer once every rank's files are durable, so stock DeepSpeed
  and ``zero_to_fp32`` read what the saver wrote and never see a partial step (it always names the
  newest committed step; ``save_latest`` is not used).
* Saves whose step is not a multiple of ``persist_interval`` (or called with ``persist=False``)
  stay in memory only: they cost one memory copy and survive the death of the training process.
* ``engine.load_checkpoint(dir)`` loads the newest step that every rank holds complete in memory
  and that is at least as new as the newest commit, else the newest commit from storage
  (``flash.last_load`` says which). Files a rank needs but another rank holds (the model states of
  ZeRO 0-2, written by rank 0 only) are sent over the process group.
* Tags name steps (``global_step<N>``); a save into the checkpoint directory under another tag
  raises. Saves and loads outside that directory use DeepSpeed's stock engine. A save that not
  every rank calls fails after ``barrier_timeout_s`` on the ranks that did, with nothing saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fnmatch
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config import CheckpointerConfig
from ..core import collectives
from ..core.checkpointer import Checkpointer
from ..core.layout import Layout
from ..core.results import PersistResult, SaveResult
from ..core.state import Codec, FileSpec
from ..core.storage import write_bytes
from ..errors import FlashCkptError, missing_dependency

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory
except ImportError as exc:  # pragma: no cover - exercised only without deepspeed
    raise missing_dependency("deepspeed", "deepspeed") from exc

from ._common import declare_resume, log_save, verified_choice  # noqa: E402
from ._deepspeed_load import memory_sd_loader  # noqa: E402
from ._transfer import exchange, gloo_group  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["TAG_FORMAT", "FlashCheckpointEngine", "disable", "enable", "ensure_enabled", "load_step", "save_step"]

TAG_FORMAT = "global_step{step}"
"""DeepSpeed's default tag (``save_checkpoint(tag=None)``), which names a step's directory."""
LATEST = "latest"
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""What ``DeepSpeedEngine._copy_recovery_script`` copies next to the step directories."""


@dataclass
class _Save:
    """The save in progress: where its files go and what DeepSpeed has handed over so far."""

    step: int
    tag: str
    step_dir: str
    """Absolute path of the step's directory; files are keyed relative to it."""
    nested: bool
    """``save_dir`` is itself a step directory (``checkpoint-N/global_stepN/...``, as the HF
    Trainer saves): ``latest`` and the recovery scripts are files of the step."""
    persist: bool
    save_latest: bool
    files: dict[str, Any] = field(default_factory=dict)
    folder: str | None = None
    """The step's directory relative to the checkpoint directory, when the caller named it (else the layout's)."""


class FlashCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that snapshots into shared memory and persists in the background.

    DeepSpeed calls ``create(info)``, ``save(state_dict, path)`` for each file this rank writes,
    then ``commit(info)`` on every rank; ``commit`` hands the collected files to the
    :class:`~flashckpt_integrations.Checkpointer` as one step. Install it with :func:`enable`,
    which also routes ``engine.save_checkpoint``/``load_checkpoint`` through this object.
    """

    def __init__(
        self,
        engine: Any,
        checkpointer: Checkpointer,
        *,
        tag_format: str = TAG_FORMAT,
        persist_interval: int | None = 1,
        barrier_timeout_s: float = 300.0,
        owns_checkpointer: bool = True,
    ) -> None:
        super().__init__(None)
        if persist_interval is not None and (isinstance(persist_interval, bool) or not isinstance(persist_interval, int)
                                             or persist_interval < 1):
            raise ValueError(f"persist_interval={persist_interval!r} must be a positive number of steps or None "
                             "(None: persist only saves called with persist=True)")
        if barrier_timeout_s <= 0:
            raise ValueError(f"barrier_timeout_s={barrier_timeout_s} must be a positive number of seconds")
        self.name = "FlashCheckpointEngine"
        self.engine = engine
        self.checkpointer = checkpointer
        self.tag_format = tag_format
        self._tag_pattern = _template_pattern(tag_format)
        self._dir_pattern = _template_pattern(checkpointer.layout.step_dir)
        self.persist_interval = persist_interval
        self.barrier_timeout_s = barrier_timeout_s
        self._owns_checkpointer = owns_checkpointer
        self._stock = engine.checkpoint_engine or TorchCheckpointEngine(None)
        """DeepSpeed's own engine, for saves and loads that are not flash checkpoints."""
        self._current: _Save | None = None
        self._served: dict[str, Any] = {}
        self._listing: list[str] = []
        self._check_group = _new_gloo_group(datetime.timedelta(seconds=barrier_timeout_s))
        self._transfer_group: Any = None
        self._scripts_written = False
        self.last_save: SaveResult | None = None
        self.last_load: tuple[int, str] | None = None
        """``(step, "memory" | "storage")`` of the newest ``load_checkpoint`` through this engine."""

    # --- DeepSpeed's CheckpointEngine interface ---------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._current is None:
            self._stock.create(info)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self._current is None:  # a save that is not a flash checkpoint (e.g. save_16bit_model)
            os.makedirs(path, exist_ok=exist_ok)
        # flash saves: the saver creates directories as it writes files

    def save(self, state_dict: Any, path: str) -> None:
        current = self._current
        if current is None:
            return self._stock.save(state_dict, path)
        current.files[self._relative(path, current)] = FileSpec(state_dict)

    def load(self, path: str, map_location: Any = None) -> Any:
        key = os.path.abspath(path)
        if key in self._served:
            return self._served[key]
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        current = self._current
        if current is None:
            return self._stock.commit(info)
        if current.nested and current.save_latest and self.checkpointer.rank == 0:
            latest = os.path.join(os.path.abspath(info.save_dir), LATEST)
            current.files[self._relative(latest, current)] = FileSpec(current.tag.encode(), Codec.BYTES)
        result = self.checkpointer.save(current.step, files=current.files, persist=current.persist,
                                        folder=current.folder)
        self.last_save = result  # save_checkpoint logs it, with the time of the whole call
        return result.ok

    def preserves_storage_sharing(self) -> bool:
        return True  # the torch codec stores whole storages, as torch.save does

    # --- engine.save_checkpoint / load_checkpoint (installed by enable) ----------------------

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        persist: bool | None = None,
        files: Mapping[str, Any] | None = None,
        report: bool = True,
        step: int | None = None,
        folder: str | None = None,
    ) -> SaveResult | bool:
        """``DeepSpeedEngine.save_checkpoint`` into shared memory; persisted by policy or ``persist``.

        ``files`` adds files of the caller to the same step (paths relative to the step's
        directory), e.g. a trainer's own state. Returns the :class:`SaveResult` (DeepSpeed's own
        ``save_checkpoint`` returns True); a save outside the checkpoint directory is stock.
        Logs once (INFO) how long the whole call held training and where the step lands;
        ``report=False``: not logged (a trainer that logs its own save of the step).
        ``step`` (with ``folder``, relative to the checkpoint directory; the layout's name of the
        step when None): a caller that names the step and its directory itself (``save_dir`` is
        that directory, ``latest`` and the recovery scripts are files of it, any ``tag``).
        """
        started = time.perf_counter()
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        tag = str(tag) if tag is not None else self.tag_format.format(step=self.engine.global_steps)
        args = (save_dir, tag, dict(client_state or {}), save_latest, exclude_frozen_parameters)
        target = self._target(save_dir, tag) if step is None else self._named_target(save_dir, step, folder)
        if target is None:
            with self._stock_engine():
                return self._original_save(*args)
        step, step_dir, nested = target
        persist = self._persist_policy(step) if persist is None else bool(persist)
        self._check_every_rank_saves(step, persist)
        self.last_save = None
        self._current = _Save(step, tag, step_dir, nested, persist, save_latest, dict(files or {}), folder)
        try:
            self._original_save(save_dir, tag, dict(client_state or {}), False, exclude_frozen_parameters)
        finally:
            self._current = None
        if report and self.last_save is not None:
            log_save(logger, self.checkpointer.rank, "DeepSpeed save_checkpoint", self.last_save, step_dir,
                     time.perf_counter() - started)
        return self.last_save

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
        *,
        prefer_memory: bool = True,
        memory_files: Mapping[str, Any] | None = None,
        step: int | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """``DeepSpeedEngine.load_checkpoint`` from memory when a newer complete snapshot is there.

        Collective: every rank must call it. Returns what DeepSpeed's returns. ``memory_files``:
        this rank's files of the step, already read with ``Checkpointer.load(step, weights_only=False)``
        by a caller that needs the step's other files too (a trainer), so they are not read twice.
        ``step``: a caller that names the step itself, ``load_dir`` being that step's directory
        (any name; see ``save_checkpoint``).
        """
        kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                      load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                      custom_load_fn=custom_load_fn)
        load_abs = os.path.abspath(load_dir)
        dir_step = self._step_of_dir(load_abs) if step is None else step
        if load_abs != self.checkpointer.url and dir_step is None:
            return self._original_load(load_dir, tag, **kwargs)  # not ours: stock
        if dir_step is None and tag is not None:
            dir_step = self._parse_tag(tag)
        # ZeRO-3 without optimizer states rebuilds the weights with zero_to_fp32 from storage
        reads_storage = self.engine.zero_optimization_partition_weights() and not load_optimizer_states
        choice = self._choose(dir_step, prefer_memory and not reads_storage)
        if choice is None:
            return self._original_load(load_dir, tag, **kwargs)  # nothing of ours: e.g. a stock `latest`
        step, source = choice
        declare_resume(self.checkpointer, step, source)  # DeepSpeed's loader reads it, not Checkpointer.load
        if tag is None and load_abs == self.checkpointer.url:
            tag = self.checkpointer.layout.step_path(step)
        if source == "memory":
            step_dir = load_abs if dir_step is not None and load_abs != self.checkpointer.url else None
            with self._serving_memory(step, load_dir, tag, kwargs, memory_files, step_dir) as tag:
                out = self._original_load(load_dir, tag, **kwargs)
        else:
            out = self._original_load(load_dir, tag, **kwargs)
        self.last_load = (step, source)
        logger.info("[RANK %d] loaded step %d from %s", self.checkpointer.rank, step, source)
        return out

    def copy_recovery_scripts(self, save_path: str) -> None:
        """Rank 0's ``_copy_recovery_script``: ship ``zero_to_fp32.py`` and friends without writing here."""
        current = self._current
        if current is None:
            return self._original_copy_scripts(save_path)
        scripts = _recovery_scripts()
        if current.nested:
            for name, data in scripts.items():
                current.files[self._relative(os.path.join(save_path, name), current)] = FileSpec(data, Codec.BYTES)
        elif not self._scripts_written:
            # Tools, not checkpoint state: identical for every step, written next to `latest` once.
            storage = self.checkpointer.storage
            for name, data in scripts.items():
                if not storage.exists(name) or storage.read(name) != data:
                    write_bytes(storage, name, data)
            self._scripts_written = True

    # --- lifetime ----------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> PersistResult | None:
        """Wait until this rank's persisting saves are committed (or failed)."""
        return self.checkpointer.wait(timeout)

    def close(self) -> None:
        """Wait for in-flight persisting and free the shared memory (when this engine made the checkpointer)."""
        if self._owns_checkpointer:
            self.checkpointer.close()

    # --- saving internals --------------------------------------------------------------------

    def _target(self, save_dir: str, tag: str) -> tuple[int, str, bool] | None:
        """``(step, step directory, nested)`` of a save into the checkpoint directory, else None."""
        root = self.checkpointer.url
        save_abs = os.path.abspath(save_dir)
        if save_abs == root:
            step = self._parse_tag(tag)
            step_dir = os.path.join(root, self.checkpointer.layout.step_path(step))
            if os.path.join(root, tag) != step_dir:
                raise ValueError(
                    f"tag {tag!r} saved into {root} would not be the step directory "
                    f"{self.checkpointer.layout.step_path(step)!r} of this checkpointer's layout; save into "
                    f"that step directory (save_dir={step_dir!r}) instead"
                )
            return step, step_dir, False
        step = self._step_of_dir(save_abs)
        if step is not None:
            return step, save_abs, True
        return None

    def _named_target(self, save_dir: str, step: int, folder: str | None) -> tuple[int, str, bool]:
        """``(step, step directory, nested)`` of a save whose caller names the step and its folder."""
        step_dir = os.path.join(self.checkpointer.url, folder or self.checkpointer.layout.step_path(step))
        if os.path.abspath(save_dir) != os.path.normpath(step_dir):
            raise ValueError(f"save_dir {save_dir!r} is not the directory {step_dir!r} of step {step}")
        return step, os.path.normpath(step_dir), True

    def _parse_tag(self, tag: str) -> int:
        match = self._tag_pattern.fullmatch(tag)
        if match is None or self.tag_format.format(step=int(match.group(1))) != tag:
            example = self.tag_format.format(step=self.engine.global_steps)
            raise ValueError(
                f"checkpoint tag {tag!r} does not name a training step: flash checkpoints in "
                f"{self.checkpointer.url} are saved per step under tags of the form {self.tag_format!r} "
                f"(e.g. {example!r}, DeepSpeed's default with tag=None). Save other tags (such as 'best') "
                "into another directory, where DeepSpeed's stock engine writes them."
            )
        return int(match.group(1))

    def _step_of_dir(self, path: str) -> int | None:
        root = self.checkpointer.url
        if not path.startswith(root + os.sep):
            return None
        match = self._dir_pattern.fullmatch(os.path.relpath(path, root).replace(os.sep, "/"))
        return int(match.group(1)) if match else None

    def _relative(self, path: str, current: _Save) -> str:
        full = os.path.abspath(path)
        if not full.startswith(current.step_dir + os.sep):
            raise FlashCkptError(
                f"DeepSpeed wrote {full}, outside the step directory {current.step_dir} being saved; "
                "this DeepSpeed feature is not supported by the flash engine yet"
            )
        return os.path.relpath(full, current.step_dir).replace(os.sep, "/")

    def _persist_policy(self, step: int) -> bool:
        return self.persist_interval is not None and step % self.persist_interval == 0

    def _check_every_rank_saves(self, step: int, persist: bool) -> None:
        """Every rank saves the same step, decided within ``barrier_timeout_s`` (never a hang)."""
        ck = self.checkpointer
        if ck.world_size == 1:
            return
        try:
            views = collectives.all_gather_object([step, persist], ck.world_size, self._check_group)
        except RuntimeError as exc:
            raise FlashCkptError(
                f"save_checkpoint of step {step} was not called by every one of the {ck.world_size} ranks within "
                f"{self.barrier_timeout_s}s ({exc}). Call engine.save_checkpoint on every rank: each rank saves "
                "its own part of the state. Nothing of this step was saved."
            ) from exc
        steps, persists = {v[0] for v in views}, {v[1] for v in views}
        if len(steps) > 1 or len(persists) > 1:
            raise FlashCkptError(
                f"the ranks disagree on the checkpoint being saved: (step, persist) by rank = "
                f"{[tuple(v) for v in views]}. Pass the same tag and persist on every rank. Nothing was saved."
            )

    @contextlib.contextmanager
    def _stock_engine(self) -> Iterator[None]:
        """Let DeepSpeed's own engine write a save that is not a flash checkpoint."""
        self.engine.checkpoint_engine = self._stock
        try:
            yield
        finally:
            self.engine.checkpoint_engine = self

    # --- loading internals -------------------------------------------------------------------

    def _choose(self, step: int | None, prefer_memory: bool) -> tuple[int, str] | None:
        """The step to load and its source, agreed by every rank (collective); a memory snapshot
        only once every rank's copy verifies (one that fails is discarded: choose again)."""
        return verified_choice(self.checkpointer, lambda: self._choose_once(step, prefer_memory))

    def _choose_once(self, step: int | None, prefer_memory: bool) -> tuple[int, str] | None:
        ck = self.checkpointer
        if prefer_memory:  # a rank whose node lost its memory fetches the step from a peer's replica
            ck.recover_replicas(step)
        committed = ck.committed_steps()
        memory = ck.memory_steps() if prefer_memory else []
        views = collectives.all_gather_object([memory, committed[-1] if committed else None],
                                              ck.world_size, ck.process_group)
        common = set.intersection(*(set(v[0]) for v in views))
        newest_commit = views[0][1]
        if step is not None:
            return step, "memory" if step in common else "storage"
        eligible = [s for s in common if newest_commit is None or s >= newest_commit]
        if eligible:
            return max(eligible), "memory"
        return None if newest_commit is None else (newest_commit, "storage")

    @contextlib.contextmanager
    def _serving_memory(self, step: int, load_dir: str, tag: str | None, kwargs: dict[str, Any],
                        files: Mapping[str, Any] | None, step_dir: str | None = None) -> Iterator[str]:
        """Serve ``step``'s files from memory to DeepSpeed's stock loading code, as the files of
        ``step_dir`` (the layout's directory of the step when None); yields the tag."""
        ck = self.checkpointer
        if files is None:
            result = ck.load(step, map_location="cpu", weights_only=False)
            if result is None or result.source != "memory":
                raise FlashCkptError(f"the memory snapshot of step {step} vanished while it was being loaded")
            files = result.files
        step_dir = step_dir or os.path.join(ck.url, ck.layout.step_path(step))
        own = {os.path.join(step_dir, rel): obj for rel, obj in files.items()}
        held = collectives.all_gather_object(sorted(own), ck.world_size, ck.process_group)
        self._listing = sorted(set().union(*held))
        tag = tag if tag is not None else self._tag_in(step_dir)
        needed = self._needed_files(load_dir, tag, kwargs)
        self._served = {**own, **exchange(own, needed, ck.rank, ck.world_size, ck.process_group, self._transfers())}
        engine = self.engine
        engine._get_all_ckpt_names = self._memory_ckpt_names
        original_factory = SDLoaderFactory.__dict__["get_sd_loader"]
        SDLoaderFactory.get_sd_loader = staticmethod(memory_sd_loader)
        try:
            yield tag
        finally:
            SDLoaderFactory.get_sd_loader = original_factory
            del engine._get_all_ckpt_names
            self._served, self._listing = {}, []

    def _tag_in(self, step_dir: str) -> str:
        """The one tag directory of a snapshot saved into a step directory (``checkpoint-N/global_stepN``)."""
        tags = {os.path.relpath(p, step_dir).split(os.sep)[0] for p in self._listing
                if os.sep in os.path.relpath(p, step_dir)}
        if len(tags) != 1:
            raise FlashCkptError(f"the memory snapshot of {step_dir} holds the tags {sorted(tags)}; pass tag=...")
        return tags.pop()

    def _needed_files(self, load_dir: str, tag: str, kwargs: dict[str, Any]) -> list[str]:
        """The files DeepSpeed's loader reads on this rank (absolute paths)."""
        engine = self.engine
        names = [engine._get_ckpt_name(load_dir, tag)]
        if engine.zero_optimization() and kwargs["load_optimizer_states"] and not kwargs["load_module_only"]:
            if engine.zero_elastic_checkpoint():
                dp_size = dist.get_world_size(group=engine.optimizer.dp_process_group)
                names += engine._get_mp_rank_zero_checkpoint_names(load_dir, tag, engine.checkpoint_mp_rank, dp_size,
                                                                   engine.bfloat16_enabled())
            else:
                names.append(engine._get_zero_ckpt_name(load_dir, tag))
        return [os.path.abspath(n) for n in names]

    def _transfers(self) -> Any:
        if self._transfer_group is None:
            self._transfer_group = gloo_group()
        return self._transfer_group

    def _memory_ckpt_names(self, checkpoints_path: str, tag: str) -> list[str]:
        """``_get_all_ckpt_names`` over the snapshot's files instead of a directory listing."""
        engine = self.engine
        pattern = engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*",
                                        pp_placeholder="0" if engine.load_universal_checkpoint() else None)
        pattern = os.path.abspath(pattern)
        return [p for p in self._listing if fnmatch.fnmatchcase(p, pattern)]


# --- switching it on ---------------------------------------------------------------------------


def enable(
    engine: Any,
    checkpoint_dir: str | os.PathLike | None = None,
    *,
    checkpointer: Checkpointer | None = None,
    config: CheckpointerConfig | Mapping[str, Any] | None = None,
    persist_interval: int | None = 1,
    tag_format: str = TAG_FORMAT,
    barrier_timeout_s: float = 300.0,
) -> FlashCheckpointEngine:
    """Route ``engine``'s checkpoints in ``checkpoint_dir`` through shared memory and the saver.

    Call it on every rank, after ``deepspeed.initialize``. ``config`` is a
    :class:`~flashckpt_integrations.CheckpointerConfig` (or a dict of its fields); its layout is
    set to DeepSpeed's (``global_step<N>`` directories, ``latest``). Pass ``checkpointer`` instead
    to share one with other files of the same steps (its layout then decides the directories).
    ``persist_interval``: persist saves whose step is a multiple of it; the others stay in memory.
    ``barrier_timeout_s``: how long a save waits for every rank to call it before it fails.
    """
    if isinstance(getattr(engine, "checkpoint_engine", None), FlashCheckpointEngine):
        raise FlashCkptError("flash checkpoints are already enabled for this engine; call disable(engine) first")
    if engine.zero_nvme_offload_optimizer():
        raise FlashCkptError("ZeRO NVMe offload copies its swap files into the checkpoint itself; the flash engine "
                             "does not support it. Keep DeepSpeed's stock checkpointing for this configuration.")
    if (checkpoint_dir is None) == (checkpointer is None):
        raise ValueError("pass exactly one of checkpoint_dir or checkpointer")
    owns = checkpointer is None
    if checkpointer is None:
        if "://" in os.fspath(checkpoint_dir):
            raise ValueError(f"{checkpoint_dir!r}: DeepSpeed loads checkpoints through the local file system; use "
                             "a local or mounted directory")
        layout = Layout(step_dir=tag_format, tracker=LATEST, tracker_content=tag_format)
        if isinstance(config, CheckpointerConfig):
            config = dataclasses.replace(config, layout=layout)
        else:
            config = CheckpointerConfig(**{**dict(config or {}), "layout": layout})
        checkpointer = Checkpointer(checkpoint_dir, config)
    flash = FlashCheckpointEngine(engine, checkpointer, tag_format=tag_format, persist_interval=persist_interval,
                                  barrier_timeout_s=barrier_timeout_s, owns_checkpointer=owns)
    if checkpointer.config.async_snapshot and engine.optimizer is not None:
        checkpointer.attach_optimizer(_base_optimizer(engine.optimizer))
    flash._original_save = engine.save_checkpoint
    flash._original_load = engine.load_checkpoint
    flash._original_copy_scripts = engine._copy_recovery_script
    engine.checkpoint_engine = flash
    engine.save_checkpoint = flash.save_checkpoint
    engine.load_checkpoint = flash.load_checkpoint
    engine._copy_recovery_script = flash.copy_recovery_scripts
    return flash


def disable(engine: Any, *, close: bool = True, missing_ok: bool = False) -> None:
    """Give ``engine`` back its stock checkpointing; ``close`` also closes the flash engine."""
    flash = engine.checkpoint_engine
    if not isinstance(flash, FlashCheckpointEngine):
        if missing_ok:
            return
        raise FlashCkptError("flash checkpoints are not enabled for this engine")
    for name in ("save_checkpoint", "load_checkpoint", "_copy_recovery_script"):
        engine.__dict__.pop(name, None)
    engine.checkpoint_engine = flash._stock
    if close:
        flash.close()


def ensure_enabled(engine: Any, checkpointer: Checkpointer) -> FlashCheckpointEngine:
    """The flash engine of ``engine`` on ``checkpointer`` (a trainer's), enabled on first use.

    For trainers whose checkpoints hold DeepSpeed's files beside their own: every save is
    persisted only when the trainer says so. Collective on first use (every rank calls it).
    """
    current = engine.checkpoint_engine
    if isinstance(current, FlashCheckpointEngine):
        if current.checkpointer is checkpointer:
            return current
        disable(engine, close=False)
    return enable(engine, checkpointer=checkpointer, persist_interval=None)


def save_step(engine: Any, checkpointer: Checkpointer, step: int, files: Mapping[str, Any], *,
              persist: bool, folder: str | None = None, tag: str | None = None, **kwargs: Any) -> SaveResult:
    """Save ``step`` of a trainer: ``engine.save_checkpoint`` into the step's directory of the
    checkpointer's layout (``checkpoint-N/global_stepN/...``, ``latest``, ``zero_to_fp32.py``) and the
    trainer's ``files`` (relative to that directory), as one checkpoint committed together.
    ``folder``: the step's directory (relative to the checkpoint directory) instead of the layout's;
    ``tag``: DeepSpeed's tag directory in it (``global_step<N>`` when None)."""
    ensure_enabled(engine, checkpointer)
    if folder is None and tag is None:
        step_dir = os.path.join(checkpointer.url, checkpointer.layout.step_path(step))
        return engine.save_checkpoint(step_dir, persist=persist, files=files, report=False, **kwargs)
    step_dir = os.path.join(checkpointer.url, folder or checkpointer.layout.step_path(step))
    return engine.save_checkpoint(step_dir, tag or TAG_FORMAT.format(step=step), persist=persist, files=files,
                                  report=False, step=step, folder=folder, **kwargs)


def load_step(engine: Any, checkpointer: Checkpointer, step: int, files: Mapping[str, Any] | None = None, *,
              folder: str | None = None, tag: str | None = None, **kwargs: Any
              ) -> tuple[str | None, dict[str, Any] | None]:
    """Load DeepSpeed's part of ``step`` of a trainer's checkpoint, from memory when every rank holds it.

    ``files``: this rank's files of the step as the trainer read them with
    ``checkpointer.load(step, weights_only=False)``, served without reading them again. ``folder``
    and ``tag``: as :func:`save_step` saved them.
    """
    ensure_enabled(engine, checkpointer)
    if folder is None and tag is None:
        step_dir = os.path.join(checkpointer.url, checkpointer.layout.step_path(step))
        return engine.load_checkpoint(step_dir, memory_files=files, **kwargs)
    step_dir = os.path.join(checkpointer.url, folder or checkpointer.layout.step_path(step))
    return engine.load_checkpoint(step_dir, tag or TAG_FORMAT.format(step=step), memory_files=files, step=step,
                                  **kwargs)


# --- helpers ---------------------------------------------------------------------------------


def _template_pattern(template: str) -> re.Pattern[str]:
    """A regex matching ``template.format(step=N)``, capturing N."""
    before, sep, after = template.partition("{step}")
    if not sep or "{" in before + after:
        raise ValueError(f"template {template!r} must contain '{{step}}' once and no other field")
    return re.compile(re.escape(before) + r"(\d+)" + re.escape(after))


def _new_gloo_group(timeout: datetime.timedelta) -> Any:
    """A gloo group whose collectives fail after ``timeout`` (a rank that never calls them)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def _recovery_scripts() -> dict[str, bytes]:
    import deepspeed.utils

    base = os.path.dirname(deepspeed.utils.__file__)
    out = {}
    for name in RECOVERY_SCRIPTS:
        with open(os.path.join(base, name), "rb") as f:
            out[name] = f.read()
    return out


def _base_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's ZeRO / fp16 wrappers."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer
