"""Flash checkpoints for ``accelerate``: ``save_state`` / ``load_state`` through shared memory.

```python
from flashckpt_integrations.adapters.accelerate import enable

accelerator = Accelerator(project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True))
model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
flash = enable(accelerator)            # accelerator.save_state / load_state now go through the core
accelerator.load_state()               # newest of: memory snapshot, committed checkpoint (no-op if none)
...
accelerator.save_state()                       # persisted:   <project_dir>/checkpoints/checkpoint_<N>/
flash.save_state(step, persist=False)          # memory only: survives a crash of this process
flash.close()                                  # at the end: waits for persisting, frees the memory
```

The folders hold exactly what ``Accelerator.save_state`` writes (``model.safetensors``,
``optimizer.bin``, ``scheduler.bin``, ``sampler.bin``, ``random_states_<rank>.pkl``,
``custom_checkpoint_<i>.pkl``, ``scaler.pt``), so the stock ``Accelerator.load_state`` reads them.
A folder appears only once every rank's files are durable (it is staged and renamed at the commit);
``ProjectConfiguration.total_limit`` is applied by the saver after each commit.

Without ``automatic_checkpoint_naming`` pass ``checkpoint_dir``: checkpoints then go to
``<checkpoint_dir>/checkpoint_<step>/`` and ``save_state(step)`` names the step;
``accelerator.save_state(<checkpoint_dir>/step_<N>)`` (any folder under it whose name ends with
its step) writes into that folder.

Under FSDP (``SHARDED_STATE_DICT`` or ``FULL_STATE_DICT``, FSDP1 or FSDP2) the folders hold what the
stock ``save_state`` writes there: ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (every process's
shards, DCP) or rank 0's ``pytorch_model_fsdp.bin`` and ``optimizer.bin``, beside the scheduler,
sampler and RNG files; a resume from memory reads the shards in place from every process's slot.
Under DeepSpeed (ZeRO 0-3, one model) the engine's files come from the flash DeepSpeed engine
(:mod:`.deepspeed`) into the same folder, as ``save_state`` has DeepSpeed write them:
``pytorch_model/`` (``mp_rank_00_model_states.pt``, ``zero_pp_rank_<r>_..._optim_states.pt``),
``latest`` and ``zero_to_fp32.py``; a resume from memory serves them to DeepSpeed's own loader from the
slots. Megatron-LM and XLA accelerators are refused at ``enable()``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..config import CheckpointerConfig
from ..core import reshard
from ..core.checkpointer import Checkpointer
from ..core.layout import Layout
from ..core.results import SaveResult, SaveStatus
from ..core.retention import RetentionPolicy
from ..core.state import Codec, FileSpec
from ..errors import FlashCkptError, LayoutMismatchError, missing_dependency
from . import _accelerate_fsdp as files_of_fsdp
from ._common import (
    declare_resume,
    files_written_by,
    log_save,
    newest_memory_step,
    quiet_about,
    resharding_sources,
    share_from_rank0,
    write_byte_files,
)
from .fsdp import gather_full

try:
    from accelerate import Accelerator
    from accelerate.checkpointing import (
        load_accelerator_state,
        load_custom_state,
        save_accelerator_state,
        save_custom_state,
    )
    from accelerate.utils import (
        MODEL_NAME,
        OPTIMIZER_NAME,
        SAFE_MODEL_NAME,
        SCALER_NAME,
        SCHEDULER_NAME,
    )
    from accelerate.utils.other import clean_state_dict_for_safetensors
except ImportError as exc:  # pragma: no cover - exercised only without accelerate
    raise missing_dependency("accelerate", "accelerate") from exc

logger = logging.getLogger(__name__)

__all__ = ["AccelerateCheckpointer", "enable"]

CHECKPOINTS_DIR = "checkpoints"
"""Where ``automatic_checkpoint_naming`` puts checkpoints, under ``project_dir``."""
STEP_DIR = "checkpoint_{step}"
_UNSUPPORTED = ("MEGATRON_LM", "XLA")
_QUIET = ("accelerate.checkpointing",)
"""accelerate's logger, whose "saved in <folder>" messages would name a scratch folder."""


DEEPSPEED_TAG = MODEL_NAME
"""The DeepSpeed tag (the folder of the engine's files) that ``save_state`` gives the first model."""


def _deepspeed() -> Any:
    from . import deepspeed as flash_deepspeed  # imported here: the adapter never needs DeepSpeed installed

    return flash_deepspeed


def _numbered(name: str, index: int, ext: str) -> str:
    """accelerate's names of the ``index``-th model, optimizer or scheduler file."""
    return f"{name}{'' if index == 0 else f'_{index}'}.{ext}"


def _is_engine_file(name: str) -> bool:
    """A DeepSpeed engine's file (the engine shares them between ranks itself, as each needs them)."""
    return name.startswith(f"{DEEPSPEED_TAG}/")


def _is_rank_file(name: str) -> bool:
    return name.startswith("random_states_")


class AccelerateCheckpointer:
    """``Accelerator.save_state`` / ``load_state`` through the flash checkpoint core.

    ``checkpoint_dir``: folder of the checkpoints; with ``automatic_checkpoint_naming`` it must be
    left out (checkpoints go to ``<project_dir>/checkpoints/checkpoint_<N>`` as accelerate names them).
    ``config``: a :class:`~flashckpt_integrations.CheckpointerConfig` or a dict of its fields; without
    a retention policy, ``ProjectConfiguration.total_limit`` newest checkpoints are kept.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        checkpoint_dir: str | os.PathLike | None = None,
        *,
        config: CheckpointerConfig | Mapping[str, Any] | None = None,
    ) -> None:
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if kind in _UNSUPPORTED:
            raise FlashCkptError(
                f"accelerate's {kind} state is engine-managed and this adapter does not snapshot it; use the "
                "stock Accelerator.save_state for it")
        self.deepspeed = kind == "DEEPSPEED"
        """The model is a DeepSpeed engine: its files are DeepSpeed's (``pytorch_model/``, ``latest``)."""
        self.fsdp = accelerator.state.fsdp_plugin if kind == "FSDP" else None
        """accelerate's FSDP plugin when the models are FSDP (their files are accelerate's FSDP files), else None."""
        if self.fsdp is not None and files_of_fsdp.unsupported(self.fsdp):
            raise FlashCkptError(f"accelerate's {files_of_fsdp.unsupported(self.fsdp)} is not supported by the flash "
                                 "accelerate adapter: use SHARDED_STATE_DICT or FULL_STATE_DICT, or the stock "
                                 "Accelerator.save_state")
        project = accelerator.project_configuration
        if project.automatic_checkpoint_naming:
            if checkpoint_dir is not None:
                raise ValueError("checkpoint_dir is set by ProjectConfiguration(project_dir=...) when "
                                 "automatic_checkpoint_naming=True; leave checkpoint_dir out")
            if project.project_dir is None:
                raise ValueError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
            root, step_dir = project.project_dir, f"{CHECKPOINTS_DIR}/{STEP_DIR}"
        else:
            if checkpoint_dir is None:
                raise ValueError("pass checkpoint_dir, or create the Accelerator with "
                                 "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)")
            root, step_dir = os.fspath(checkpoint_dir), STEP_DIR
        local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        if project.save_on_each_node and local < accelerator.num_processes:
            raise FlashCkptError("save_on_each_node is not supported by the flash accelerate adapter yet; "
                                 "use shared storage (the default) or the stock save_state")
        self.accelerator = accelerator
        self.root = root if "://" in root else os.path.abspath(os.path.expanduser(root))
        self.layout = Layout(step_dir=step_dir, tracker=None, staging=True)
        self.checkpointer = Checkpointer(self.root, self._make_config(config, project.total_limit))
        self.resumed_from: tuple[int, str] | None = None
        """``(step, "memory" | "storage")`` of the last ``load_state``, or None."""
        self.resumed_folder: str | None = None
        """The folder of the last ``load_state``'s checkpoint (relative to the checkpoint directory), or None."""
        self._attached: set[int] = set()
        self._saved_since_restore = False

    def _make_config(self, given: Any, total_limit: int | None) -> CheckpointerConfig:
        if isinstance(given, CheckpointerConfig):
            config = dataclasses.replace(given, layout=self.layout)
        else:
            config = CheckpointerConfig(**{**dict(given or {}), "layout": self.layout})
        if not config.retention.enabled and total_limit:
            config = dataclasses.replace(config, retention=RetentionPolicy(keep_last=total_limit))
        return config

    def checkpoint_path(self, step: int, folder: str | None = None) -> str:
        """The folder of ``step``'s checkpoint (it exists once the step is committed): ``folder``
        (relative to the checkpoint directory), the folder it was committed in, or the default name."""
        folder = folder or self.checkpointer.committed_folder(step) or self.layout.step_path(step)
        return os.path.join(self.root, folder)

    def folder_of(self, path: str | os.PathLike) -> tuple[int, str] | None:
        """``(step, folder relative to the checkpoint directory)`` of a checkpoint folder under it,
        its step being the number that ends the folder's name (``step_4``, ``epoch_2``,
        ``checkpoint_7``); None for a path elsewhere or without such a number."""
        path = os.path.normpath(os.path.abspath(os.fspath(path)))
        root = os.path.normpath(self.root)
        match = _NUMBER_RE.search(os.path.basename(path))
        if match is None or not path.startswith(root + os.sep):
            return None
        return int(match.group(1)), os.path.relpath(path, root).replace(os.sep, "/")

    # --- saving ----------------------------------------------------------------------------

    def save_state(self, step: int | None = None, *, persist: bool = True,
                   safe_serialization: bool = True, folder: str | None = None) -> SaveResult:
        """Snapshot what ``Accelerator.save_state`` writes for ``step``; persist it or keep it in memory.

        Collective: call it on every process. ``step`` defaults to the save iteration of
        ``automatic_checkpoint_naming`` (which then advances, as with the stock ``save_state``).
        ``folder``: the checkpoint's folder relative to the checkpoint directory (the default
        name when None). Logs once (INFO) how long the whole call held training and where the
        checkpoint lands.
        """
        started = time.perf_counter()
        acc = self.accelerator
        project = acc.project_configuration
        if step is None:
            if not project.automatic_checkpoint_naming:
                raise ValueError("save_state() needs the step when automatic_checkpoint_naming is off: "
                                 "save_state(step)")
            step = project.iteration
        self._warn_if_behind_the_restore(step)
        self._attach_optimizers()
        files = self._files(step, safe_serialization)
        if self.deepspeed:  # the engine's files, through the flash DeepSpeed engine, in the same step
            result = _deepspeed().save_step(self._engine(), self.checkpointer, step, files, persist=persist,
                                            folder=folder or self.layout.step_path(step), tag=DEEPSPEED_TAG)
        else:
            result = self.checkpointer.save(step, files=files, persist=persist, folder=folder)
        if result.status is SaveStatus.FAILED:
            logger.error("flashckpt: step %d was not saved: %s", step, result.reason)
        if project.automatic_checkpoint_naming and step >= project.iteration:
            project.iteration = step + 1
        log_save(logger, self.checkpointer.rank, "accelerate save_state", result,
                 os.path.join(self.root, folder or self.layout.step_path(step)), time.perf_counter() - started)
        return result

    def _warn_if_behind_the_restore(self, step: int) -> None:
        """A first save after a restore of step S, of a step below S: the loop was almost surely not
        told where to resume (it trains steps 1, 2, ... again on top of step S's state). Said once,
        at WARNING; a committed folder of that step is replaced only after this warning."""
        first, self._saved_since_restore = not self._saved_since_restore, True
        if not first or self.resumed_from is None or step >= self.resumed_from[0]:
            return
        resumed = self.resumed_from[0]
        replaced = (f"; it replaces the committed {self.checkpoint_path(step)}"
                    if step in self.checkpointer.committed_steps() else "")
        logger.warning(
            "flashckpt: saving step %d right after restoring step %d: the training loop was not told where to "
            "resume, so it is training steps it already trained on top of step %d's state%s. Start the loop "
            "after the restored step: flash.resume_point(batches_per_epoch) gives the epoch and the batches to "
            "skip", step, resumed, resumed, replaced)

    def resume_point(self, batches_per_epoch: int, *, gradient_accumulation_steps: int = 1) -> tuple[int, int]:
        """Where a loop of the accelerate examples' shape resumes after ``load_state``: ``(epoch, batches
        to skip in that epoch)``, from the restored step (``(0, 0)`` when nothing was restored).

        The step is what the loop passed to ``save_state`` (``step_<N>``: optimizer steps, or batches
        with ``gradient_accumulation_steps``). Skip the batches with
        ``accelerator.skip_first_batches(loader, skip)`` in that epoch only. A checkpoint in a folder
        named ``epoch_<N>`` (saved at the end of epoch N, as the examples name it) resumes at the
        start of epoch N + 1.
        """
        if batches_per_epoch < 1 or gradient_accumulation_steps < 1:
            raise ValueError(f"batches_per_epoch ({batches_per_epoch}) and gradient_accumulation_steps "
                             f"({gradient_accumulation_steps}) must be at least 1")
        if self.resumed_from is None:
            return 0, 0
        if self.resumed_folder is not None and os.path.basename(self.resumed_folder).startswith("epoch_"):
            return self.resumed_from[0] + 1, 0
        batches = self.resumed_from[0] * gradient_accumulation_steps
        return batches // batches_per_epoch, batches % batches_per_epoch

    def _attach_optimizers(self) -> None:
        """With ``async_snapshot``, make each prepared optimizer's step wait for the overlapped copy
        (the torch optimizer inside accelerate's wrapper; once each, also those prepared later)."""
        if not self.checkpointer.config.async_snapshot:
            return
        for optimizer in self.accelerator._optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if isinstance(inner, torch.optim.Optimizer) and id(inner) not in self._attached:
                self._attached.add(id(inner))
                self.checkpointer.attach_optimizer(inner)

    def _files(self, step: int, safe_serialization: bool) -> dict[str, Any]:
        acc = self.accelerator
        # (under FSDP or DeepSpeed the models' files are FSDP's or the engine's: the hooks see no weights, as with
        # save_state)
        engine_files = self.fsdp is not None or self.deepspeed  # the models' files come from FSDP or the engine
        weights = [] if engine_files else [acc.get_state_dict(model, unwrap=False) for model in acc._models]
        files: dict[str, Any] = {}
        # user hooks see the weights and a folder, as with save_state; what they write there is saved too
        hooks = list(acc._save_model_state_pre_hook.values())
        if hooks and acc.is_main_process:
            files.update(files_written_by(lambda scratch: [hook(acc._models, weights, scratch) for hook in hooks]))
        elif hooks:
            files_written_by(lambda scratch: [hook(acc._models, weights, scratch) for hook in hooks])
        # sampler, dataloader state and this process's RNG states: the stock code's own bytes
        files.update(files_written_by(lambda scratch: save_accelerator_state(
            scratch, [], [], [], acc._dataloaders, acc.state.process_index, acc.step, None), quiet=_QUIET))
        if self.fsdp is not None:  # collective: every process's shards, or the full state gathered once
            files.update(self._fsdp_files())
        if not acc.is_main_process:
            return files
        for i, state in enumerate(weights):
            if safe_serialization:
                files[_numbered(SAFE_MODEL_NAME, i, "safetensors")] = FileSpec(
                    clean_state_dict_for_safetensors(state), Codec.SAFETENSORS, metadata={"format": "pt"})
            else:
                files[_numbered(MODEL_NAME, i, "bin")] = FileSpec(state)
        for i, optimizer in enumerate([] if engine_files else acc._optimizers):
            files[_numbered(OPTIMIZER_NAME, i, "bin")] = FileSpec(optimizer.state_dict())
        for i, scheduler in enumerate(self._schedulers()):
            files[_numbered(SCHEDULER_NAME, i, "bin")] = FileSpec(scheduler.state_dict())
        if acc.scaler is not None:
            files[SCALER_NAME] = FileSpec(acc.scaler.state_dict())
        for i, obj in enumerate(acc._custom_objects):
            files.update(files_written_by(lambda scratch, obj=obj, i=i: save_custom_state(obj, scratch, i),
                                          quiet=_QUIET))
        return files

    def _schedulers(self) -> list[Any]:
        """The schedulers ``save_state`` writes as ``scheduler.bin``: under DeepSpeed, those not in the engine."""
        if not self.deepspeed:
            return list(self.accelerator._schedulers)
        from accelerate.utils import DeepSpeedSchedulerWrapper

        return [s for s in self.accelerator._schedulers if not isinstance(s, DeepSpeedSchedulerWrapper)]

    def _engine(self) -> Any:
        """The one DeepSpeed engine (``accelerator.prepare`` makes one per model; one is supported)."""
        models = self.accelerator._models
        if len(models) != 1:
            raise FlashCkptError(f"the flash accelerate adapter supports one DeepSpeed model, this accelerator has "
                                 f"{len(models)}; use the stock Accelerator.save_state")
        return models[0]

    def _fsdp_files(self) -> dict[str, FileSpec]:
        """What ``save_fsdp_model`` / ``save_fsdp_optimizer`` write for each model and its optimizer (collective)."""
        acc, files = self.accelerator, {}
        for i, model in enumerate(acc._models):
            optimizer = acc._optimizers[i] if i < len(acc._optimizers) else None  # as save_state pairs them
            if files_of_fsdp.is_sharded(self.fsdp):
                files.update(files_of_fsdp.sharded_files(self.fsdp, model, optimizer, self.checkpointer.process_group,
                                                         i))
                continue
            model_sd, optim_sd = gather_full(model, optimizer)
            if acc.is_main_process:
                files[files_of_fsdp.full_model_file(i)] = FileSpec(model_sd)
                if optim_sd is not None:
                    files[files_of_fsdp.full_optimizer_file(i)] = FileSpec(optim_sd)
        return files

    # --- loading ---------------------------------------------------------------------------

    def load_state(self, step: int | None = None) -> tuple[int, str] | None:
        """Restore the newest snapshot (or ``step``): from memory when every process holds it, else storage.

        Collective. Returns ``(step, "memory" | "storage")``, or None when there is no checkpoint.
        """
        ck = self.checkpointer
        memory = newest_memory_step(ck) if step is None else (step if self.held_by_all(step) else None)
        sources = self._resharding_sources() if memory is None and step is None else None
        if sources is not None:  # saved by another number of processes: their snapshots, resharded
            memory = sources.choice.step
            try:
                ck.start_attempt(memory, from_memory=True, tag=sources.tag)
                self._load_from_memory(memory, sources)
            finally:
                sources.close()
            self.resumed_from, self.resumed_folder = (memory, "memory"), sources.folder or self.layout.step_path(memory)
            logger.warning("flashckpt: step %d was saved by %d processes and is resharded onto %d from their memory",
                           memory, sources.choice.world_size, ck.world_size)
        elif memory is None:
            committed = ck.committed_steps()
            step = step if step is not None else (committed[-1] if committed else None)
            if step is None:
                self.resumed_from = self.resumed_folder = None
                return None
            if step not in committed:
                raise FlashCkptError(f"step {step} is neither committed in {self.root} nor held in memory by "
                                     f"every process; committed steps: {committed}")
            declare_resume(ck, step)  # the stock loader reads it: this attempt continues that commit's lineage
            self._stock_load(self.checkpoint_path(step))
            self.resumed_from, self.resumed_folder = (step, "storage"), ck.committed_folder(step)
        else:
            folder = ck.snapshot_folder(memory)
            self._load_from_memory(memory)
            self.resumed_from, self.resumed_folder = (memory, "memory"), folder
        step = self.resumed_from[0]
        project = self.accelerator.project_configuration
        if project.automatic_checkpoint_naming:
            project.iteration = step + 1
        where = (f"shared memory, the snapshot for {self.checkpoint_path(step, self.resumed_folder)}"
                 if self.resumed_from[1] == "memory" else self.checkpoint_path(step))
        logger.warning("flashckpt: resumed from step %d (%s); the next save should be of a later step", step, where)
        self._saved_since_restore = False
        return self.resumed_from

    def _resharding_sources(self) -> reshard.Sources | None:
        """The snapshots that a job of another number of processes left in memory, newer than any commit,
        when the state reshards (FSDP's sharded state dict); else None (collective)."""
        ck = self.checkpointer
        return resharding_sources(ck, ck.committed_steps(), framework="accelerate",
                                  reshards=self.fsdp is not None and files_of_fsdp.is_sharded(self.fsdp))

    def held_by_all(self, step: int) -> bool:
        """Whether every process holds ``step`` in memory (collective; fetches it from a peer first)."""
        from ..core import collectives

        self.checkpointer.recover_replicas(step)
        views = collectives.all_gather_object(step in self.checkpointer.memory_steps(),
                                              self.checkpointer.world_size, self.checkpointer.process_group)
        return all(views)

    def _stock_load(self, path: str) -> None:
        stock = getattr(self.accelerator, "_flashckpt_stock_load_state", self.accelerator.load_state)
        stock(path)

    def _load_from_memory(self, step: int, sources: reshard.Sources | None = None) -> None:
        acc, ck = self.accelerator, self.checkpointer
        if sources is not None:  # another number of processes saved it: the old ranks' files
            files = files_of_fsdp.resharded_files(ck, sources, _is_rank_file)
        elif self.fsdp is not None:  # the DCP folders stay in the slots until the models and optimizers load them
            files = files_of_fsdp.memory_files(ck, step, _is_rank_file)
        elif self.deepspeed:  # the engine's files hold its objects; the flash engine shares them itself
            files = ck.load(step, map_location="cpu", weights_only=False).files
            files = share_from_rank0(files, ck.rank, lambda name: _is_rank_file(name) or _is_engine_file(name))
        else:
            files = share_from_rank0(ck.load(step, map_location="cpu").files, ck.rank, _is_rank_file)
        folder = write_byte_files(files, prefix=f"flashckpt-memory-checkpoint_{step}-")
        try:
            models = list(acc._models)
            for hook in acc._load_model_state_pre_hook.values():
                hook(models, folder)
            if self.fsdp is not None:
                self._load_fsdp(step, files, sources)
            elif self.deepspeed:
                engine_files = {k: v for k, v in files.items() if _is_engine_file(k)}
                _deepspeed().load_step(self._engine(), ck, step, engine_files, tag=DEEPSPEED_TAG,
                                       folder=ck.committed_folder(step) or self.layout.step_path(step))
            else:
                for i, model in enumerate(models):
                    _load_model(model, files, i)
                for i, optimizer in enumerate(acc._optimizers):
                    optimizer.load_state_dict(files[_numbered(OPTIMIZER_NAME, i, "bin")])
            for i, scheduler in enumerate(self._schedulers()):
                scheduler.load_state_dict(files[_numbered(SCHEDULER_NAME, i, "bin")])
            if acc.scaler is not None:
                acc.scaler.load_state_dict(files[SCALER_NAME])
            override = load_accelerator_state(folder, [], [], [], acc._dataloaders, acc.state.process_index, None)
            if "step" in override:
                acc.step = override["step"]
            with quiet_about(folder, _QUIET):  # its "Loading the state of ... from <folder>" names a scratch folder
                for i, obj in enumerate(acc._custom_objects):
                    load_custom_state(obj, folder, i)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _load_fsdp(self, step: int, files: dict[str, Any], sources: reshard.Sources | None) -> None:
        """Each model and optimizer from the snapshot of ``step``, as ``load_fsdp_model`` / ``load_fsdp_optimizer``
        read a folder: shards read in place from every process's slot, or rank 0's full state scattered
        (collective)."""
        acc, ck, plugin = self.accelerator, self.checkpointer, self.fsdp
        hint = "Load its committed folder instead: accelerator.load_state(<folder>)."
        for i, model in enumerate(acc._models):
            if files_of_fsdp.is_sharded(plugin):
                files_of_fsdp.load_sharded_model(plugin, ck, model, step, i, sources=sources)
                continue
            model_sd = files.pop(files_of_fsdp.full_model_file(i), None)
            files_of_fsdp.require_on_rank0(ck, model_sd, step, files_of_fsdp.full_model_file(i), hint)
            files_of_fsdp.set_full(model, model_sd or {}, None)
        for i, optimizer in enumerate(acc._optimizers):
            if files_of_fsdp.is_sharded(plugin):
                files_of_fsdp.load_sharded_optimizer(plugin, ck, acc._models[i], optimizer, step, i, sources=sources)
                continue
            optim_sd = files.pop(files_of_fsdp.full_optimizer_file(i), None)
            files_of_fsdp.require_on_rank0(ck, optim_sd, step, files_of_fsdp.full_optimizer_file(i), hint)
            files_of_fsdp.set_full(acc._models[i], None, (optimizer, optim_sd or {}))

    # --- lifetime --------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> Any:
        """Wait until every persisting save of this process is committed (or failed)."""
        return self.checkpointer.wait(timeout)

    def close(self) -> None:
        """Wait for in-flight persisting, then free the shared memory."""
        self.checkpointer.close()


def _load_model(model: torch.nn.Module, files: Mapping[str, Any], index: int) -> None:
    state = files.get(_numbered(SAFE_MODEL_NAME, index, "safetensors"))
    if state is None:
        state = files.get(_numbered(MODEL_NAME, index, "bin"))
    if state is None:
        raise LayoutMismatchError(f"the snapshot holds no weights for model {index}; register the same models "
                                  "(accelerator.prepare) in the same order as when it was saved")
    live = model.state_dict()
    aliases = _aliases(model)
    missing = [k for k in live if k not in state and k not in aliases]
    unexpected = [k for k in state if k not in live]
    shapes = [f"{k}: saved {tuple(state[k].shape)}, model {tuple(live[k].shape)}"
              for k in state if k in live and tuple(state[k].shape) != tuple(live[k].shape)]
    if missing or unexpected or shapes:
        raise LayoutMismatchError(f"model {index} does not match the snapshot: missing keys {missing}, "
                                  f"unexpected keys {unexpected}, different shapes {shapes}")
    model.load_state_dict(state, strict=False)


def _aliases(model: torch.nn.Module) -> set[str]:
    """Names of tensors that share storage with an earlier name (dropped from safetensors files)."""
    seen: set[tuple[int, int]] = set()
    out = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            out.add(name)
        seen.add(key)
    return out


_NUMBER_RE = re.compile(r"(\d+)$")
"""The number that ends a checkpoint folder's name: its step (``step_4``, ``epoch_2``, ``checkpoint_7``)."""


def enable(
    accelerator: Accelerator,
    checkpoint_dir: str | os.PathLike | None = None,
    *,
    config: CheckpointerConfig | Mapping[str, Any] | None = None,
) -> AccelerateCheckpointer:
    """Route ``accelerator.save_state`` / ``load_state`` through an :class:`AccelerateCheckpointer`.

    ``save_state(output_dir=None)`` persists the next automatic checkpoint; ``save_state(path)``
    persists into ``path``, any folder under the checkpoint directory whose name ends with its step
    (``step_<N>``, ``epoch_<N>``, ``checkpoint_<N>``); any other folder (``best``, one elsewhere) is
    written by the stock ``save_state``, with a WARNING that it is not a flash checkpoint (with
    ``automatic_checkpoint_naming``, as the stock code ignores the path, it is the next automatic
    checkpoint).
    ``load_state()`` restores the newest snapshot (memory or storage) and does nothing when there is
    none; ``load_state(path)`` of a folder this
    job committed restores that step (from memory when every process holds it), any other path is
    read by the stock code. A restore returns ``(step, "memory" | "storage")`` and says so in a WARNING
    (scripts rarely configure logging). Returns the checkpointer (for memory-only saves,
    ``resume_point``, ``wait`` and ``close``).
    """
    flash = AccelerateCheckpointer(accelerator, checkpoint_dir, config=config)
    stock_load, stock_save = accelerator.load_state, accelerator.save_state
    accelerator._flashckpt_stock_load_state = stock_load

    def save_state(output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        step, folder = None, None
        if output_dir is not None:
            ours = flash.folder_of(output_dir)
            if ours is None and accelerator.project_configuration.automatic_checkpoint_naming:
                # as with the stock save_state, whose automatic naming ignores the path
                logger.warning("flashckpt: save_state(%r): with automatic_checkpoint_naming accelerate ignores the "
                               "path; this is the next automatic checkpoint", os.fspath(output_dir))
            elif ours is None:  # a folder without a step in its name, or elsewhere: the stock save
                logger.warning(
                    "flashckpt: save_state(%r) is not a flash checkpoint (those go under %s, into a folder whose "
                    "name ends with its step: step_<N>, epoch_<N>, checkpoint_<N>); the stock save_state writes "
                    "it, holding training until it is written", os.fspath(output_dir), flash.root)
                return stock_save(output_dir, safe_serialization=safe_serialization, **kwargs)
            else:
                step, folder = ours
                if folder == flash.layout.step_path(step):
                    folder = None  # the default name: as a save without a path names it
        result = flash.save_state(step, safe_serialization=safe_serialization, folder=folder)
        if not result.ok:
            raise FlashCkptError(f"save_state of step {result.step} did not happen: {result.reason}")
        return os.path.join(flash.root, folder or flash.layout.step_path(result.step))

    def load_state(input_dir: str | None = None, **kwargs: Any) -> tuple[int, str] | None:
        if input_dir is None:
            return flash.load_state()
        ours = flash.folder_of(input_dir)
        if ours is not None and _holds(flash, *ours):
            return flash.load_state(ours[0])
        return stock_load(input_dir, **kwargs)  # another run's checkpoint, or any other folder

    accelerator.save_state = save_state
    accelerator.load_state = load_state
    return flash


def _holds(flash: AccelerateCheckpointer, step: int, folder: str) -> bool:
    """Whether ``folder`` is the checkpoint of ``step`` that this job committed, or the step is in memory."""
    committed = flash.checkpointer.committed_folder(step)
    if committed is not None:
        return os.path.normpath(committed) == os.path.normpath(folder)
    return flash.held_by_all(step)  # collective, as the caller's choice must be
