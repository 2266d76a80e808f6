"""DeepSpeed in :class:`~flashckpt_integrations.adapters.hf_trainer.FlashCkptTrainer`: one engine, one checkpoint.

Under DeepSpeed the stock ``Trainer`` writes ``checkpoint-N/`` with the engine's own files
(``global_stepN/...``, ``latest``, ``zero_to_fp32.py``) beside its own (weights, scheduler, RNG
states, ``trainer_state.json``, config). Here the engine's files come from the flash DeepSpeed engine
(:mod:`.deepspeed`), the Trainer's are added to the same step, and both are committed together.
A resume goes through the same engine: from the ranks' slots, or from the committed folder.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ..core.results import SaveResult
from ..core.state import FileSpec

if TYPE_CHECKING:
    from .hf_trainer import FlashCkptTrainer, _MemoryResume


def _engine_adapter() -> Any:
    from . import deepspeed as flash_deepspeed  # imported here: hf_trainer never needs DeepSpeed installed

    return flash_deepspeed


def state_files(trainer: FlashCkptTrainer, persist: bool) -> dict[str, FileSpec]:
    """The Trainer's own files of a DeepSpeed snapshot (the engine adds its optimizer and model states)."""
    files: dict[str, FileSpec] = {}
    if persist:  # the weights file of a stock checkpoint (a resume reads the engine's files instead)
        files.update(_weights(trainer))
    if trainer.args.should_save:  # config, generation config, tokenizer, training args
        files.update(trainer._flash_config_files(refresh=persist))
    return files


def _weights(trainer: FlashCkptTrainer) -> dict[str, FileSpec]:
    """The weights ``save_model`` writes under DeepSpeed (ZeRO-3: the gathered 16-bit ones; collective)."""
    if trainer.accelerator.state.deepspeed_plugin.zero_stage != 3:
        return trainer._flash_model_files() if trainer.args.should_save else {}
    try:
        state_dict = trainer.accelerator.get_state_dict(trainer.deepspeed)
    except ValueError:  # stage3_gather_16bit_weights_on_model_save is off: the stock code writes none
        return {}
    return trainer._flash_model_files(state_dict) if trainer.args.should_save else {}


def saves_scheduler(trainer: FlashCkptTrainer) -> bool:
    """A Trainer scheduler is ``scheduler.pt``; a DeepSpeed one lives in the engine's files."""
    from accelerate.utils import DeepSpeedSchedulerWrapper

    return not isinstance(trainer.lr_scheduler, DeepSpeedSchedulerWrapper)


def save(trainer: FlashCkptTrainer, step: int, files: dict[str, Any], persist: bool) -> SaveResult:
    """``engine.save_checkpoint`` through the flash engine, with the Trainer's ``files`` in the same step."""
    return _engine_adapter().save_step(trainer.model_wrapped, trainer.flash_checkpointer, step, files,
                                       persist=persist)


def is_own_file(name: str, files: dict[str, Any]) -> bool:
    """Files each rank keeps on a resume from memory: its RNG state, and the engine's (shared by the engine)."""
    return name.startswith("rng_state") or not isinstance(files[name], (bytes, bytearray))


def resume(trainer: FlashCkptTrainer, resume_from_checkpoint: str, strict: bool) -> None:
    """Load the engine's part of a checkpoint through the flash engine (the stock code would bypass it)."""
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    memory: _MemoryResume | None = trainer._flash_resume
    engine = trainer.model_wrapped
    if memory is not None and resume_from_checkpoint == memory.path:
        _engine_adapter().load_step(engine, trainer.flash_checkpointer, memory.step, memory.files,
                                    load_module_strict=strict)
    else:  # a committed folder: DeepSpeed's loader through the flash engine (or stock, if not ours)
        deepspeed_load_checkpoint(engine, resume_from_checkpoint, load_module_strict=strict)


def load_scheduler(trainer: FlashCkptTrainer, memory: _MemoryResume) -> None:
    """The engine restored the optimizer (and its scheduler); a Trainer scheduler is ``scheduler.pt``."""
    from transformers.trainer_pt_utils import reissue_pt_warnings

    scheduler = memory.files.pop("scheduler.pt", None)
    if scheduler is not None:
        with warnings.catch_warnings(record=True) as caught:
            trainer.lr_scheduler.load_state_dict(scheduler)
        reissue_pt_warnings(caught)


def enable(trainer: FlashCkptTrainer) -> None:
    """Route the engine's checkpointing through the trainer's checkpointer (collective, first use)."""
    _engine_adapter().ensure_enabled(trainer.model_wrapped, trainer.flash_checkpointer)


def finish(trainer: FlashCkptTrainer) -> None:
    """Give the engine its stock checkpointing back, before the trainer's checkpointer closes."""
    _engine_adapter().disable(trainer.model_wrapped, close=False, missing_ok=True)
