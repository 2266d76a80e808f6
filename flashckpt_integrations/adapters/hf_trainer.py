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

import copy
import dataclasses
import json
import logging
import os
import shutil
import signal
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import CheckpointerConfig
from ..core.engine import Checkpointer
from ..core.layout import Layout
from ..core.results import SaveResult
from ..core.retention import RetentionPolicy
from ..core.state import Codec, FileSpec
from ..errors import FlashCkptError, missing_dependency
from . import _hf_deepspeed, _hf_fsdp, _hf_subclass
from ._common import (
    files_written_by,
    log_save,
    newest_memory_step,
    quiet_about,
    share_from_rank0,
    step_destination,
    write_byte_files,
)

try:
    import transformers
    from transformers import PreTrainedModel, Trainer, TrainerCallback
    from transformers.trainer_pt_utils import reissue_pt_warnings
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise missing_dependency("transformers", "hf") from exc

from . import _hf_jit  # noqa: E402  (it needs transformers)

logger = logging.getLogger(__name__)

__all__ = ["FlashCkptTrainer", "FlashMemorySnapshotCallback"]

# File names of a Trainer checkpoint (stable across transformers 4.x and 5.x).
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
MAX_SHARD_SIZE = "50GB"
"""``save_pretrained``'s default, which ``Trainer`` uses: bigger models are split the same way."""

_WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


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
            trainer._flash_memory_due = True


@dataclass
class _MemoryResume:
    """A snapshot being resumed from memory: its step, the folder of its small files, its objects."""

    step: int
    path: str
    files: dict[str, Any]


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
        self._flash_resume: _MemoryResume | None = None
        self._flash_warned: set[str] = set()
        self._flash_attached: Any = None
        self._flash_config_cache: dict[str, FileSpec] | None = None
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
        model = self._flash_unwrapped()
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

    def _flash_unwrapped(self) -> Any:
        model = self.model
        if isinstance(model, PreTrainedModel):
            return model
        try:
            return self.accelerator.unwrap_model(model, keep_torch_compile=False)
        except TypeError:  # older accelerate
            return self.accelerator.unwrap_model(model)

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
            result = _hf_deepspeed.save(self, step, files, persist)
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
        best_dir = self._flash_best_checkpoint(step, persist)
        if not self.args.save_only_model:
            if should_save and (not self.is_deepspeed_enabled or _hf_deepspeed.saves_scheduler(self)):
                with warnings.catch_warnings(record=True) as caught:
                    files[SCHEDULER_NAME] = FileSpec(self.lr_scheduler.state_dict())
                reissue_pt_warnings(caught)
                scaler = getattr(self.accelerator, "scaler", None)
                if scaler is not None:
                    files[SCALER_NAME] = FileSpec(scaler.state_dict())
            files.update(self._flash_small_files(self._save_rng_state))
        if should_save:
            files[TRAINER_STATE_NAME] = FileSpec(self._flash_trainer_state(persist, best_dir), Codec.BYTES)
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
            return _hf_fsdp.state_files(self, persist)
        if self.is_deepspeed_enabled:  # the optimizer (and ZeRO model) states come with the engine's files
            return _hf_deepspeed.state_files(self, persist)
        files: dict[str, FileSpec] = {}
        if self.args.should_save:
            files.update(self._flash_model_files())
            files.update(self._flash_config_files(refresh=persist))
            if not self.args.save_only_model:
                files[OPTIMIZER_NAME] = FileSpec(self.optimizer.state_dict())
        return files

    def _flash_model_files(self, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, FileSpec]:
        """The weight files ``save_pretrained`` (or ``Trainer._save``) writes, of ``state_dict`` (a full state
        dict) or as views of the live tensors."""
        model = self._flash_unwrapped()
        if isinstance(model, PreTrainedModel):
            state_dict = model.state_dict() if state_dict is None else dict(state_dict)
            for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
                state_dict.pop(key, None)
            state_dict = _without_tied_weights(state_dict, model)
        else:
            state_dict = dict(self.model.state_dict() if state_dict is None else state_dict)
        if not getattr(self.args, "save_safetensors", True):  # transformers 4.x option
            return {WEIGHTS_NAME: FileSpec(state_dict)}
        metadata = {"format": "pt"}
        shards = _split_into_shards(state_dict)
        if shards is None:
            return {SAFE_WEIGHTS_NAME: FileSpec(state_dict, Codec.SAFETENSORS, metadata=metadata)}
        files, index = shards
        out = {name: FileSpec(part, Codec.SAFETENSORS, metadata=metadata) for name, part in files.items()}
        if isinstance(model, PreTrainedModel):
            index["metadata"] = {"total_parameters": model.num_parameters(), **index["metadata"]}
        out[SAFE_WEIGHTS_INDEX_NAME] = FileSpec((json.dumps(index, indent=2, sort_keys=True) + "\n").encode(),
                                                Codec.BYTES)
        return out

    def _save_quietly(self, directory: str) -> None:
        """``Trainer._save`` without the weights: config, generation config, tokenizer, training args.

        Its "Saving model checkpoint to <directory>" would name a scratch folder: it is left out.
        """
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()
        loggers = [name for name in list(logging.Logger.manager.loggerDict)
                   if name == "transformers" or name.startswith("transformers.")]
        try:
            with quiet_about(directory, loggers):
                self._save(directory, state_dict={})
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()

    def _flash_config_files(self, refresh: bool) -> dict[str, FileSpec]:
        """What ``Trainer._save`` writes besides the weights: config, generation config, tokenizer,
        training args.

        A persisting save (``refresh``) writes them afresh; a memory-only snapshot carries the last
        ones (they do not change while training), so that a snapshot persisted from memory (after a
        crash or on SIGTERM) is a checkpoint ``from_pretrained`` and a stock resume read.
        """
        if refresh or self._flash_config_cache is None:
            self._flash_config_cache = self._flash_small_files(self._save_quietly)
        return dict(self._flash_config_cache)

    @staticmethod
    def _flash_small_files(write: Any) -> dict[str, FileSpec]:
        """Let the stock code ``write(directory)`` its small files; return them as byte files."""
        # dummy weights of state_dict={} are skipped: the real ones come from memory
        return files_written_by(write, skip=lambda rel: rel in _WEIGHT_FILES)

    def _flash_best_checkpoint(self, step: int, persist: bool) -> str | None:
        """``best_model_checkpoint`` as ``_save_checkpoint`` sets it (the folder exists once committed)."""
        best = self.state.best_model_checkpoint
        strategy = str(getattr(self.args.save_strategy, "value", self.args.save_strategy))
        if strategy in ("steps", "epoch", "best") and self.state.best_global_step:
            best_dir = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if (persist and self.state.best_global_step == step) or os.path.exists(best_dir):
                best = best_dir
                if persist:
                    self.state.best_model_checkpoint = best_dir
        return best

    def _flash_trainer_state(self, persist: bool, best_model_checkpoint: str | None) -> bytes:
        """``trainer_state.json`` byte for byte as ``TrainerState.save_to_json`` writes it.

        A persisted save updates the live state's callback states as ``_save_checkpoint`` does; a
        memory snapshot records the same content without touching the live state.
        """
        stateful = self.state.stateful_callbacks if persist else copy.deepcopy(self.state.stateful_callbacks)
        exportable = _exportable_state_class()
        if exportable is not None:
            for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, exportable)]:
                name = cb.__class__.__name__
                if isinstance(stateful.get(name), list):
                    stateful[name].append(cb.state())
                else:
                    stateful[name] = cb.state()
        data = dataclasses.asdict(self.state)
        data["stateful_callbacks"] = copy.deepcopy(stateful)
        data["best_model_checkpoint"] = best_model_checkpoint
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()

    # --- resuming --------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        resume_from_checkpoint = _resume_flag(resume_from_checkpoint)
        self.flash_resumed_from = None
        self._flash_memory_due, self._flash_saved_step, self._flash_prepared = False, None, False
        flash = trial is None and self._flash_unsupported() is None
        if flash:
            ck = self.flash_checkpointer
            if resume_from_checkpoint is True:
                resume_from_checkpoint = self._flash_resolve_resume(ck)
            elif resume_from_checkpoint is None:
                self._flash_start_from_scratch(ck)
            else:
                self._flash_resume_from_path(ck, resume_from_checkpoint)
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

    def _flash_resolve_resume(self, ck: Checkpointer) -> str | bool:
        """The checkpoint ``resume_from_checkpoint=True`` means: memory snapshot, else newest commit."""
        step = newest_memory_step(ck)
        if step is not None:
            files = self._flash_memory_files(ck, step)
            if TRAINER_STATE_NAME not in files:
                raise FlashCkptError(
                    f"the shared-memory snapshot of step {step} holds no {TRAINER_STATE_NAME}; it was not taken "
                    "by FlashCkptTrainer. Remove it with `flashckpt clean <output_dir>` or pass a checkpoint path."
                )
            # trainer_state.json, rng_state*.pth, config.json, ...: read by the stock resume code
            path = write_byte_files(files, prefix=f"flashckpt-memory-{PREFIX_CHECKPOINT_DIR}-{step}-")
            self._flash_resume = _MemoryResume(step, path, files)
            ck.start_attempt(step, from_memory=True)  # (FSDP's and DeepSpeed's files come without ck.load)
            self.flash_resumed_from = (step, "memory")
            logger.warning("flashckpt: resuming from the shared-memory snapshot of step %d", step)
            return path
        committed = ck.committed_steps()
        if committed:
            ck.start_attempt(committed[-1])  # this run continues the one that committed it
            self.flash_resumed_from = (committed[-1], "storage")
            logger.warning("flashckpt: resuming from committed checkpoint %d", committed[-1])
            return os.path.join(self.args.output_dir, ck.layout.step_path(committed[-1]))
        ck.start_attempt(None)
        if os.path.isdir(self.args.output_dir) and get_last_checkpoint(self.args.output_dir) is not None:
            return True  # a checkpoint written by a plain Trainer: the stock lookup finds it
        logger.warning("flashckpt: no snapshot in memory and no checkpoint in %s; training starts from scratch",
                       self.args.output_dir)
        return None

    def _flash_start_from_scratch(self, ck: Checkpointer) -> None:
        """``resume_from_checkpoint=None``: a new run in ``output_dir``; say what of an earlier run it leaves."""
        memory = newest_memory_step(ck)  # collective
        committed = ck.committed_steps()
        if self.args.should_save and (memory is not None or committed):
            held = ([f"a shared-memory snapshot of step {memory}"] if memory is not None else []) + (
                [f"committed checkpoints of steps {committed}"] if committed else [])
            logger.warning(
                "flashckpt: %s holds %s from an earlier run, and training starts from scratch "
                "(resume_from_checkpoint=None): they are not resumed, and saves of the same steps replace them. "
                "To resume instead, pass resume_from_checkpoint=True (--resume_from_checkpoint True).",
                self.args.output_dir, " and ".join(held))
        ck.start_attempt(None)

    def _flash_resume_from_path(self, ck: Checkpointer, path: str) -> None:
        """An explicit checkpoint path: resumed by the stock code; say so when memory holds a newer snapshot."""
        step = _checkpoint_step(path)
        memory = newest_memory_step(ck)  # collective
        if self.args.should_save and memory is not None and (step is None or memory > step):
            logger.warning(
                "flashckpt: resuming from %s as asked, although shared memory holds a complete snapshot of the "
                "newer step %d; it is not used. To resume from it, pass resume_from_checkpoint=True "
                "(--resume_from_checkpoint True).", path, memory)
        inside = os.path.normpath(os.path.dirname(os.path.normpath(path))) == os.path.normpath(self.args.output_dir)
        try:
            ck.start_attempt(step if inside and step is not None else None)
        except FlashCkptError:  # not one of ours (e.g. written by a plain Trainer): a run of its own
            ck.start_attempt(None)

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
        _hf_deepspeed.enable(self)
        if resume_from_checkpoint is not None:
            _hf_deepspeed.resume(self, resume_from_checkpoint, strict=not _is_peft(self.model))
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        return model, train_dataloader

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        memory = self._flash_resume
        if memory is None or resume_from_checkpoint != memory.path:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = self.model if model is None else model
        if self.is_fsdp_enabled:  # collective: shards from every rank's slot, or rank 0's full state
            return _hf_fsdp.load_model(self, model, memory)
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
        memory = self._flash_resume
        if memory is None or checkpoint != memory.path:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self.is_deepspeed_enabled:  # (the stock part would read scheduler.pt, which stays in memory)
            return _hf_deepspeed.load_scheduler(self, memory)
        if not _is_bytes(memory.files.get(OPTIMIZER_NAME)):  # (else written by a subclass itself: in the folder)
            self._flash_load_optimizer_and_scheduler(memory)
        # The classes after this one load their own state from the folder; the stock part finds no
        # optimizer or scheduler file there (they come from memory) and loads nothing.
        super()._load_optimizer_and_scheduler(checkpoint)

    def _flash_load_optimizer_and_scheduler(self, memory: _MemoryResume) -> None:
        optimizer, scheduler = memory.files.pop(OPTIMIZER_NAME, None), memory.files.pop(SCHEDULER_NAME, None)
        if scheduler is None or (optimizer is None and not self.is_fsdp_enabled):
            return  # save_only_model: as the stock code, load neither
        if self.is_fsdp_enabled:  # collective: shards from every rank's slot, or rank 0's full state
            _hf_fsdp.load_optimizer(self, memory)
        else:
            self.optimizer.load_state_dict(optimizer)
        with warnings.catch_warnings(record=True) as caught:
            self.lr_scheduler.load_state_dict(scheduler)
        reissue_pt_warnings(caught)

    def _load_scaler(self, checkpoint: str | None) -> None:
        memory = self._flash_resume
        if memory is not None and checkpoint == memory.path and not _is_bytes(memory.files.get(SCALER_NAME)):
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
            shutil.rmtree(self._flash_resume.path, ignore_errors=True)
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


_RESUME_LATEST = {"true", "latest", "yes", "1"}
_RESUME_NONE = {"false", "none", "no", "0", ""}


def _resume_flag(value: Any) -> Any:
    """``resume_from_checkpoint`` as a command line gives it: ``"True"``/``"latest"`` mean True."""
    if value is False:
        return None
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _RESUME_LATEST:
            return True
        if word in _RESUME_NONE:
            return None
    return value


def _checkpoint_step(path: str) -> int | None:
    """The step in a ``checkpoint-<N>`` path, or None."""
    tail = os.path.basename(os.path.normpath(path)).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


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


def _exportable_state_class() -> type | None:
    try:
        from transformers.trainer_callback import ExportableState
    except ImportError:  # pragma: no cover - transformers < 4.41 has no stateful callbacks
        return None
    return ExportableState


def _without_tied_weights(state_dict: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """Drop tied duplicates as ``save_pretrained`` does (safetensors stores no aliases)."""
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        remove_tied_weights_from_state_dict = None
    if remove_tied_weights_from_state_dict is not None:
        state_dict = remove_tied_weights_from_state_dict(state_dict, model)
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:
            return state_dict
        return revert_weight_conversion(model, state_dict)
    # transformers 4.x: keep the first name of each group of tensors sharing memory, preferring
    # names that are not declared tied (the ones from_pretrained ties back)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    groups: dict[tuple[Any, int, int], list[str]] = {}
    for name, tensor in state_dict.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        groups.setdefault(key, []).append(name)
    out = dict(state_dict)
    for names in groups.values():
        if len(names) > 1:
            keep = sorted(names, key=lambda n: (any(n.endswith(t) for t in tied), n))[0]
            for name in names:
                if name != keep:
                    del out[name]
    return out


def _split_into_shards(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, dict], dict] | None:
    """Shards and index as ``save_pretrained`` makes them; None when the model fits one file."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state_dict, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    if not split.is_sharded:
        return None
    files = {name: {k: state_dict[k] for k in keys} for name, keys in split.filename_to_tensors.items()}
    return files, {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}


def _spans_nodes(world_size: int) -> bool:
    """The job has ranks on more than one node (each node's disk then holds only its own ranks' files)."""
    return world_size > int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
