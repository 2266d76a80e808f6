"""Flash checkpoints for the HuggingFace ``Trainer``, in the Trainer's own checkpoint format.

```python
from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer

trainer = FlashCkptTrainer(model=model, args=args, train_dataset=ds,
                           flash_memory_interval=10)   # memory-only snapshot every 10 steps
trainer.train(resume_from_checkpoint=True)             # newest of: memory snapshot, committed checkpoint
```

* At the Trainer's save steps (``save_strategy``/``save_steps``) the state is copied into shared
  memory in about the time of one memory copy; the node's saver writes ``<output_dir>/checkpoint-N/``
  in the background with exactly the files ``Trainer`` writes (``model.safetensors``, ``optimizer.pt``,
  ``scheduler.pt``, ``rng_state.pth`` or ``rng_state_<rank>.pth``, ``trainer_state.json``,
  ``training_args.bin``, ``config.json``, ``generation_config.json``, the tokenizer's files), so a plain
  ``Trainer`` and ``from_pretrained`` read it. The folder appears only once every rank's files are
  durable (it is written under ``.flashckpt/staging/`` and renamed at commit), so
  ``get_last_checkpoint`` never sees a partial one. ``save_total_limit`` is applied after each commit.
* Every ``flash_memory_interval`` steps (``FlashMemorySnapshotCallback``) a snapshot is also taken into
  shared memory only. It survives the death of the training process (not a reboot).
* ``train(resume_from_checkpoint=True)`` resumes from shared memory when every rank holds the same
  complete snapshot that is at least as new as the newest committed checkpoint: model weights and
  optimizer state come straight from memory, and the small files (``trainer_state.json``, RNG states)
  are laid out in a private folder that the stock resume code reads. Otherwise it resumes from the
  newest committed checkpoint through the stock code; with no checkpoint at all it starts from
  scratch (unlike the stock ``Trainer``, which raises), so one command serves first start and
  restarts. Data order and RNG continue exactly as with a
  stock resume from a checkpoint of the same step. An explicit path resumes from that path (stock),
  with a warning when memory holds a newer complete snapshot. The strings a command line gives
  (``"True"``, ``"true"``, ``"latest"``) mean ``True``. ``None`` starts from scratch, as the stock
  ``Trainer`` does, with a warning naming what an earlier run left; its saves of steps that run
  committed replace them atomically (see :mod:`flashckpt_integrations.core.commit`).
* At the end of ``train()`` in-flight persisting is awaited and the shared memory is freed. When
  training raises, the memory is kept for a restart (and in-flight persisting finishes at exit).

FSDP (accelerate's, versions 1 and 2): with ``SHARDED_STATE_DICT`` every rank's shard goes into its
slot and the saver writes the DCP folders ``pytorch_model_fsdp_0/`` and ``optimizer_0/``; with
``FULL_STATE_DICT`` rank 0 gathers the state and the saver writes ``pytorch_model_fsdp.bin``,
``optimizer.bin`` and ``model.safetensors``: the files of the stock ``Trainer``, which resumes from them.

DeepSpeed (``TrainingArguments(deepspeed=...)``): the engine's files (``global_stepN/``, ``latest``,
``zero_to_fp32.py``) come from the flash DeepSpeed engine (:mod:`.deepspeed`) into the same
``checkpoint-N/`` as the Trainer's own, committed together; a resume goes through that engine.

Trainer subclasses (TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, a user's own): list this class
first, ``class T(FlashCkptTrainer, SFTTrainer)``. What their ``_save_checkpoint`` writes into the
checkpoint folder is taken into every snapshot and committed with it; their loading methods run on
every resume (:mod:`._hf_subclass`).

Configurations this adapter does not handle yet (FSDP on XLA or with ``LOCAL_STATE_DICT``,
XLA, SageMaker MP, PEFT adapters, quantized models, tensor parallelism from ``from_pretrained``,
hyperparameter search, ``push_to_hub``, ``save_on_each_node``) fall back to the stock ``Trainer``
checkpointing, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..config import CheckpointerConfig
from ..core.checkpointer import Checkpointer
from ..core.layout import Layout
from ..core.results import SaveResult
from ..core.retention import RetentionPolicy
from ..core.state import Codec, FileSpec
from ..errors import FlashCkptError, missing_dependency
from . import _hf_deepspeed, _hf_files, _hf_fsdp, _hf_resume, _hf_subclass
from ._common import log_save, share_from_rank0, step_destination
from ._hf_files import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, WEIGHTS_NAME
from ._hf_resume import MemoryResume

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_pt_utils import reissue_pt_warnings
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise missing_dependency("transformers", "hf") from exc

from . import _hf_jit  # noqa: E402  (it needs transformers)

logger = logging.getLogger(__name__)

__all__ = ["FlashCkptTrainer", "FlashMemorySnapshotCallback"]


class FlashMemorySnapshotCallback(TrainerCallback):
    """Asks for a memory-only snapshot every ``interval`` optimizer steps.

    The snapshot itself is taken by :class:`FlashCkptTrainer` once the step's logging and
    evaluation are done (where ``Trainer`` saves), so that it holds exactly what a checkpoint of
    that step holds. A step that is also a save step is persisted instead.
    """

    def __init__(self, trainer: FlashCkptTrainer, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"flash_memory_interval={interval!r} must be a positive number of steps or None")
        self._trainer = weakref.ref(trainer)
        self.interval = interval

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None and state.global_step % self.interval == 0:
            trainer.flash_request_memory_snapshot()


class FlashCkptTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints go through shared memory and a background saver.

    Extra keyword arguments (everything else is passed to ``Trainer``):

    * ``flash_memory_interval``: take a memory-only snapshot every this many optimizer steps
      (``None``: only the Trainer's own save steps). Memory snapshots cost one memory copy of the
      state and let a crashed job resume from a newer step than the newest checkpoint on disk.
    * ``flash_config``: a :class:`~flashckpt_integrations.CheckpointerConfig` or a dict of its fields
      (e.g. ``{"async_snapshot": True}``, ``{"retention": {"keep_last": 3, "keep_every": 1000}}``).
      The layout is always the Trainer's (``checkpoint-N``, staged; one set here is refused);
      without a retention policy the newest ``save_total_limit`` checkpoints are kept.

    After ``train()``: ``flash_resumed_from`` is ``(step, "memory" | "storage")`` or ``None``, and
    ``flash_last_save`` is the :class:`~flashckpt_integrations.SaveResult` of the newest snapshot.

    With another ``Trainer`` subclass (TRL's ``SFTTrainer``, ``DPOTrainer``, ...), list this class
    first: ``class T(FlashCkptTrainer, SFTTrainer)``. Every snapshot, memory-only ones included, runs
    the whole ``_save_checkpoint`` chain with ``_get_output_dir()`` naming a scratch folder; what the
    classes write into its ``checkpoint-N/`` is committed with the snapshot (see :mod:`._hf_subclass`).
    Their ``_load_optimizer_and_scheduler`` and ``_load_scaler`` run on every resume, and read those
    files from the folder they are given (on a resume from memory, a private copy).
    """

    _flash_scope: _hf_subclass.SaveScope | None = None
    """The snapshot the ``_save_checkpoint`` chain is building, while it runs."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _hf_subclass.check_bases(cls, FlashCkptTrainer, Trainer)

    def __init__(
        self,
        *args: Any,
        flash_memory_interval: int | None = None,
        flash_config: CheckpointerConfig | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        sigterm = signal.getsignal(signal.SIGTERM)  # before the stock JIT callback (if any) replaces it
        super().__init__(*args, **kwargs)
        self._flash_config = self._flash_check_options(flash_config, flash_memory_interval)
        self._flash_checkpointer: Checkpointer | None = None
        self._flash_memory_due = False
        self._flash_prepared = False
        self._flash_saved_step: int | None = None
        self._flash_resume: MemoryResume | None = None
        self._flash_warned: set[str] = set()
        self._flash_attached: Any = None
        self._flash_config_cache = _hf_files.ConfigFiles()
        self.flash_resumed_from: tuple[int, str] | None = None
        self.flash_last_save: SaveResult | None = None
        if flash_memory_interval is not None:
            self.add_callback(FlashMemorySnapshotCallback(self, flash_memory_interval))
        if getattr(self.args, "enable_jit_checkpoint", False) and self._flash_unsupported() is None:
            _hf_jit.take_over(self, self._flash_last_save, sigterm)
        if self.args.load_best_model_at_end and self._flash_keep_last() is not None:
            logger.warning("flashckpt: retention keeps the newest %d checkpoints and does not protect the best "
                           "one yet; load_best_model_at_end may not find it", self._flash_keep_last())
        # Start the saver process now, while the job is still setting up, rather than beside the
        # first training steps (where its start-up, ~2 s of CPU, slows them). Only once the ranks
        # are known: the checkpointer takes them from the process group.
        if self._flash_unsupported() is None and (self.args.world_size == 1 or dist.is_initialized()):
            _ = self.flash_checkpointer

    # --- the checkpointer ------------------------------------------------------------------

    @property
    def flash_checkpointer(self) -> Checkpointer:
        """The checkpointer of this trainer, created on first use (after the process group exists)."""
        if self._flash_checkpointer is None:
            self._flash_checkpointer = Checkpointer(self.args.output_dir, self._flash_config)
            # (DeepSpeed: the flash DeepSpeed engine makes its own optimizer wait for an overlapped copy)
            if self._flash_checkpointer.config.async_snapshot and self.optimizer is not None \
                    and not self.is_deepspeed_enabled:
                self._flash_checkpointer.attach_optimizer(_torch_optimizer(self.optimizer))
                self._flash_attached = self.optimizer
        return self._flash_checkpointer

    def flash_request_memory_snapshot(self) -> None:
        """Take a memory-only snapshot of the current step once its logging and evaluation are done
        (where ``Trainer`` saves); :class:`FlashMemorySnapshotCallback` asks for one this way. A step
        that is also a save step is persisted instead."""
        self._flash_memory_due = True

    def _flash_keep_last(self) -> int | None:
        limit = self.args.save_total_limit
        return limit if limit is not None and limit > 0 else None

    def _flash_check_options(self, given: Any, memory_interval: int | None) -> CheckpointerConfig:
        """The checkpointer's configuration: the user's, with the Trainer's layout and retention.

        Options that cannot work together are refused here, before any training.
        """
        if given is not None and not isinstance(given, (CheckpointerConfig, Mapping)):
            raise TypeError(f"flash_config must be a CheckpointerConfig or a dict of its fields, got {type(given)}")
        fields = dataclasses.asdict(given) if isinstance(given, CheckpointerConfig) else dict(given or {})
        if ("layout" in fields if isinstance(given, Mapping)
                else isinstance(given, CheckpointerConfig) and given.layout != Layout()):
            raise ValueError("flash_config must not set 'layout': FlashCkptTrainer writes the Trainer's own "
                             "checkpoint-N folders, which the Trainer's resume looks for. Remove 'layout'.")
        if memory_interval is not None and self.args.save_only_model:
            raise ValueError(
                "flash_memory_interval takes snapshots to resume from after a crash, but save_only_model=True "
                "leaves the optimizer, scheduler and RNG states out, so a resume would not continue the run. "
                "Set save_only_model=False, or flash_memory_interval=None.")
        layout = Layout(step_dir=f"{PREFIX_CHECKPOINT_DIR}-{{step}}", tracker=None, staging=True)
        if isinstance(given, CheckpointerConfig):
            config = dataclasses.replace(given, layout=layout)
        else:
            config = CheckpointerConfig(**{**fields, "layout": layout})
        if config.retention.enabled and self._flash_keep_last() is not None:
            raise ValueError(
                f"both save_total_limit={self.args.save_total_limit} and flash_config retention "
                f"({config.retention}) say which checkpoints to keep. Set only one of them.")
        if not config.retention.enabled:
            config = dataclasses.replace(config, retention=RetentionPolicy(keep_last=self._flash_keep_last()))
        return config

    def _flash_unsupported(self) -> str | None:
        """Why the stock checkpointing must be used for this configuration, or None."""
        model = _hf_files.unwrapped_model(self)
        fsdp = _hf_fsdp.unsupported(self) if self.is_fsdp_enabled else None  # FSDP: which state_dict_type
        reasons = [
            (getattr(self, "is_fsdp_xla_enabled", False), "FSDP on XLA"),
            (fsdp is not None, fsdp),
            (is_torch_xla_available(), "XLA"),
            (is_sagemaker_mp_enabled(), "SageMaker model parallelism"),
            (getattr(self, "is_distributed_loading_by_transformers", False), "tensor parallelism"),
            (_is_peft(model), "PEFT adapters"),
            (getattr(model, "hf_quantizer", None) is not None, "quantized models"),
            (self.hp_search_backend is not None, "hyperparameter search"),
            (self.args.push_to_hub, "push_to_hub"),
            (self.args.save_on_each_node and _spans_nodes(self.args.world_size), "save_on_each_node on several nodes"),
        ]
        for applies, name in reasons:
            if applies:
                if name not in self._flash_warned:
                    self._flash_warned.add(name)
                    logger.warning("flashckpt: %s is not supported by FlashCkptTrainer yet; checkpoints use the "
                                   "stock Trainer code (no shared memory, no background saving)", name)
                return name
        return None

    # --- saving ----------------------------------------------------------------------------

    @_hf_subclass.whole_save
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        scope = self._flash_scope
        if scope is None:  # a trial, or a configuration left to the stock code
            return super()._save_checkpoint(model, trial)
        scope.files = self._flash_files(scope.step, scope.persist)
        scope.keep(self.state)
        super()._save_checkpoint(model, trial)  # the classes after this one; the stock writers skip scope.files

    def _get_output_dir(self, trial: Any) -> str:
        scope = self._flash_scope
        return scope.scratch if scope is not None else super()._get_output_dir(trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not (_internal_call and self._flash_holds(output_dir)):
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._flash_holds(output_dir):
            super()._save_optimizer_and_scheduler(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        if not self._flash_holds(output_dir):
            super()._save_scaler(output_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._flash_holds(output_dir):
            super()._save_rng_state(output_dir)

    def _flash_holds(self, output_dir: str | None) -> bool:
        """Whether a stock writer aimed at ``output_dir`` would write what the snapshot holds already."""
        return self._flash_scope is not None and self._flash_scope.holds(output_dir)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        if not self._flash_prepared:  # after the first optimizer step of this train()
            self._flash_prepared = True
            self._flash_prepare()
        super()._maybe_log_save_evaluate(*args, **kwargs)
        if self._flash_memory_due:
            self._flash_memory_due = False
            if self._flash_saved_step != self.state.global_step and self._flash_unsupported() is None:
                self._flash_snapshot(self.model_wrapped, persist=False)

    def _flash_snapshot(self, model: Any, persist: bool) -> SaveResult:
        """Snapshot what ``_save_checkpoint`` writes for this step, every class's part; persist it or not.

        Logs, once, the whole time this held training (building the files, the classes' own parts,
        the copy) and where the checkpoint lands.
        """
        started = time.perf_counter()
        ck = self.flash_checkpointer
        if ck.config.async_snapshot and self._flash_attached is not self.optimizer and not self.is_deepspeed_enabled:
            ck.attach_optimizer(_torch_optimizer(self.optimizer))
            self._flash_attached = self.optimizer
        step = self.state.global_step
        self.store_flos()
        scope = self._flash_scope = _hf_subclass.SaveScope.open(step, persist, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        try:
            with _hf_subclass.quiet(scope):
                self._save_checkpoint(model, None)  # the most derived class's: the whole chain, in the scope
            scope.restore(self.state)
            files = _hf_subclass.merge(scope, type(self))
            if persist:
                scope.move_outside(self.args.output_dir)
        finally:
            self._flash_scope = None
            scope.close()
        if self.is_deepspeed_enabled:  # the engine's files and these, committed together
            result = _hf_deepspeed.save(self, ck, step, files, persist)
        else:
            result = ck.save(step, files=files, persist=persist)
        self.flash_last_save = result
        if persist:
            self._flash_saved_step = step
        log_save(logger, ck.rank, "Trainer save", result, step_destination(ck, step), time.perf_counter() - started)
        return result

    def _flash_last_save(self) -> None:
        """The checkpoint ``enable_jit_checkpoint`` takes on SIGTERM: committed before this returns."""
        if self._flash_saved_step != self.state.global_step:
            self._flash_snapshot(self.model_wrapped, persist=True)
        outcome = self.flash_checkpointer.wait()
        if outcome is not None and not outcome.committed:
            logger.error("flashckpt: the checkpoint of step %d taken on SIGTERM was not committed: %s",
                         outcome.step, outcome.error)

    def _flash_files(self, step: int, persist: bool) -> dict[str, Any]:
        """The files ``Trainer._save_checkpoint`` writes for ``step`` (only a persisted one updates the live state)."""
        should_save = self.args.should_save
        files: dict[str, Any] = self._flash_state_files(persist)
        best_dir = _hf_files.best_checkpoint(self, step, persist)
        if not self.args.save_only_model:
            if should_save and (not self.is_deepspeed_enabled or _hf_deepspeed.saves_scheduler(self)):
                with warnings.catch_warnings(record=True) as caught:
                    files[SCHEDULER_NAME] = FileSpec(self.lr_scheduler.state_dict())
                reissue_pt_warnings(caught)
                scaler = getattr(self.accelerator, "scaler", None)
                if scaler is not None:
                    files[SCALER_NAME] = FileSpec(scaler.state_dict())
            files.update(_hf_files.small_files(self._save_rng_state))
        if should_save:
            files[TRAINER_STATE_NAME] = FileSpec(_hf_files.trainer_state_file(self, persist, best_dir), Codec.BYTES)
        return files

    def _flash_prepare(self) -> None:
        """Create the slots in the background, sized for a checkpoint, so no save pays for page faults.

        Called after the first optimizer step of ``train()``, once the optimizer's state exists. FSDP
        and DeepSpeed build their files collectively: their first save creates the slots.
        """
        strategy = str(getattr(self.args.save_strategy, "value", self.args.save_strategy))
        saves = strategy != "no" or any(isinstance(cb, FlashMemorySnapshotCallback)
                                        for cb in self.callback_handler.callbacks)
        if not saves or self.is_fsdp_enabled or self.is_deepspeed_enabled or self._flash_unsupported() is not None:
            return
        files = self._flash_files(self.state.global_step, persist=False)
        self.flash_checkpointer.prepare(files=files, background=True)

    def _flash_state_files(self, persist: bool) -> dict[str, FileSpec]:
        """The model and optimizer files of a snapshot, and with ``persist`` what ``Trainer._save`` writes."""
        if self.is_fsdp_enabled:  # collective: every rank's shards, or the full state gathered to rank 0
            return _hf_fsdp.state_files(self, self.flash_checkpointer, persist, self._flash_config_files)
        if self.is_deepspeed_enabled:  # the optimizer (and ZeRO model) states come with the engine's files
            return _hf_deepspeed.state_files(self, persist, self._flash_config_files)
        files: dict[str, FileSpec] = {}
        if self.args.should_save:
            files.update(_hf_files.weight_files(self))
            files.update(self._flash_config_files(refresh=persist))
            if not self.args.save_only_model:
                files[OPTIMIZER_NAME] = FileSpec(self.optimizer.state_dict())
        return files

    def _flash_config_files(self, refresh: bool) -> dict[str, FileSpec]:
        """What ``Trainer._save`` writes besides the weights (config, generation config, tokenizer, training
        args): written afresh with ``refresh`` (a persisting save), else the last ones (see ``ConfigFiles``)."""
        return self._flash_config_cache.get(self._save, refresh)

    # --- resuming --------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        resume_from_checkpoint = _hf_resume.resume_flag(resume_from_checkpoint)
        self.flash_resumed_from = None
        self._flash_memory_due, self._flash_saved_step, self._flash_prepared = False, None, False
        flash = trial is None and self._flash_unsupported() is None
        if flash:
            ck = self.flash_checkpointer
            if resume_from_checkpoint is True:
                resume_from_checkpoint, self._flash_resume, self.flash_resumed_from = _hf_resume.resume_latest(
                    ck, self.args, lambda step: self._flash_memory_files(ck, step),
                    _hf_fsdp.resharded_files(self, ck) if self.is_fsdp_enabled else None)
            elif resume_from_checkpoint is None:
                _hf_resume.start_from_scratch(ck, self.args)
            else:
                _hf_resume.resume_from_path(ck, self.args, resume_from_checkpoint)
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except BaseException:
            self._flash_abort()
            raise
        finally:
            self._flash_drop_resume()
        self._flash_finish()
        return output

    def _flash_memory_files(self, ck: Checkpointer, step: int) -> dict[str, Any]:
        """The files of the memory snapshot of ``step``; rank 0's on every rank, except each rank's own (collective)."""
        if self.is_fsdp_enabled:  # the DCP folders stay in the slots until the model and optimizer load them
            return _hf_fsdp.memory_files(ck, step)
        if self.is_deepspeed_enabled:  # DeepSpeed's files hold its objects; its engine shares them itself
            files = ck.load(step, map_location="cpu", weights_only=False).files
            return share_from_rank0(files, ck.rank, is_own=lambda name: _hf_deepspeed.is_own_file(name, files))
        # The RNG files are byte files (torch.save by the stock code): nothing here needs numpy unpickled.
        files = ck.load(step, map_location="cpu").files
        if ck.world_size > 1:  # rank 0's files, and each rank's own: its RNG state and what its classes wrote
            files = share_from_rank0(files, ck.rank, is_own=lambda name: ck.rank != 0 or name.startswith("rng_state"))
        return files

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        if not self.is_deepspeed_enabled or self._flash_unsupported() is not None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        # The DeepSpeed engine exists once the stock preparation has run; resume through the flash engine.
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        ck = self.flash_checkpointer
        _hf_deepspeed.enable(self, ck)
        if resume_from_checkpoint is not None:
            _hf_deepspeed.resume(self, ck, resume_from_checkpoint, self._flash_memory_for(resume_from_checkpoint),
                                 strict=not _is_peft(self.model))
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        return model, train_dataloader

    def _flash_memory_for(self, checkpoint: str | None) -> MemoryResume | None:
        """The snapshot resumed from memory when ``checkpoint`` is the folder of its small files, else None
        (a folder that the stock code reads)."""
        memory = self._flash_resume
        return memory if memory is not None and checkpoint == memory.path else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        memory = self._flash_memory_for(resume_from_checkpoint)
        if memory is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = self.model if model is None else model
        if self.is_fsdp_enabled:  # collective: shards from every rank's slot, or rank 0's full state
            return _hf_fsdp.load_model(self, self.flash_checkpointer, model, memory)
        names = [n for n in memory.files if n == WEIGHTS_NAME or (n.startswith("model") and n.endswith(".safetensors"))]
        if any(_is_bytes(memory.files[n]) for n in names):  # written by a subclass itself: in the folder
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        state_dict: dict[str, torch.Tensor] = {}
        for name in names:  # popped: the copies are freed once they are in the model
            state_dict.update(memory.files.pop(name))
        if not state_dict:
            raise FlashCkptError(f"the shared-memory snapshot of step {memory.step} holds no model weights")
        load_result = model.load_state_dict(state_dict, False)
        del state_dict
        self._issue_warnings_after_load(load_result)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        memory = self._flash_memory_for(checkpoint)
        if memory is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self.is_deepspeed_enabled:  # (the stock part would read scheduler.pt, which stays in memory)
            return _hf_deepspeed.load_scheduler(self, memory)
        if not _is_bytes(memory.files.get(OPTIMIZER_NAME)):  # (else written by a subclass itself: in the folder)
            self._flash_load_optimizer_and_scheduler(memory)
        # The classes after this one load their own state from the folder; the stock part finds no
        # optimizer or scheduler file there (they come from memory) and loads nothing.
        super()._load_optimizer_and_scheduler(checkpoint)

    def _flash_load_optimizer_and_scheduler(self, memory: MemoryResume) -> None:
        optimizer, scheduler = memory.files.pop(OPTIMIZER_NAME, None), memory.files.pop(SCHEDULER_NAME, None)
        if scheduler is None or (optimizer is None and not self.is_fsdp_enabled):
            return  # save_only_model: as the stock code, load neither
        if self.is_fsdp_enabled:  # collective: shards from every rank's slot, or rank 0's full state
            _hf_fsdp.load_optimizer(self, self.flash_checkpointer, memory)
        else:
            self.optimizer.load_state_dict(optimizer)
        with warnings.catch_warnings(record=True) as caught:
            self.lr_scheduler.load_state_dict(scheduler)
        reissue_pt_warnings(caught)

    def _load_scaler(self, checkpoint: str | None) -> None:
        memory = self._flash_memory_for(checkpoint)
        if memory is not None and not _is_bytes(memory.files.get(SCALER_NAME)):
            scaler = memory.files.pop(SCALER_NAME, None)
            if scaler is not None and getattr(self.accelerator, "scaler", None) is not None:
                self.accelerator.scaler.load_state_dict(scaler)
        super()._load_scaler(checkpoint)  # the classes after this one (the stock part finds no scaler.pt)

    def _load_best_model(self) -> None:
        if self._flash_checkpointer is not None:
            self._flash_checkpointer.wait()  # the best checkpoint may still be being written
        super()._load_best_model()

    # --- end of training -------------------------------------------------------------------

    def _flash_drop_resume(self) -> None:
        if self._flash_resume is not None:
            self._flash_resume.close()
            self._flash_resume = None

    def _flash_finish(self) -> None:
        """Wait for in-flight persisting, then free the shared memory."""
        ck, self._flash_checkpointer = self._flash_checkpointer, None
        self._flash_attached = None
        if ck is None:
            return
        if self.is_deepspeed_enabled:
            _hf_deepspeed.finish(self)
        result = ck.wait()
        if result is not None and not result.committed:
            logger.error("flashckpt: the last checkpoint (step %d) was not committed: %s", result.step, result.error)
        ck.close()

    def _flash_abort(self) -> None:
        """Training raised: let in-flight persisting finish, keep the memory for a restart."""
        if self._flash_checkpointer is not None:
            try:
                self._flash_checkpointer.wait()
            except Exception as exc:  # never mask the training error
                logger.error("flashckpt: in-flight checkpoints did not finish: %s", exc)


# --- helpers -------------------------------------------------------------------------------


def _is_bytes(obj: Any) -> bool:
    """A file of a memory snapshot held as its bytes (laid out in the resume folder for the stock loaders)."""
    return isinstance(obj, (bytes, bytearray))


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def _is_peft(model: Any) -> bool:
    if getattr(model, "_hf_peft_config_loaded", False):
        return True
    try:
        from transformers.trainer_utils import _is_peft_model
    except ImportError:  # pragma: no cover
        return False
    return bool(_is_peft_model(model))


def _spans_nodes(world_size: int) -> bool:
    """The job has ranks on more than one node (each node's disk then holds only its own ranks' files)."""
    return world_size > int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
