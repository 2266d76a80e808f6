"""DeepSpeed in :class:`~flashckpt_integrations.adapters.hf_trainer.FlashCkptTrainer`: one engine, one checkpoint.

Under DeepSpeed the stock ``Trainer`` writes ``checkpoint-N/`` with the engine's own files
(``global_stepN/...``, ``latest``, ``zero_to_fp32.py``) beside its own (weights, scheduler, RNG
states, ``trainer_state.json``, config). Here the engine's files come from the flash DeepSpeed engine
(:mod:`.deepspeed`), the Trainer's are added to the same step, and both are committed together.
A resume goes through the same engine: from the ranks' slots, or from the committed folder.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.checkpointer import Checkpointer
from ..core.results import SaveResult
from ..core.state import FileSpec
from ._hf_files import SCHEDULER_NAME, weight_files

if TYPE_CHECKING:
    from transformers import Trainer

    from ._hf_resume import MemoryResume


def _engine_adapter() -> Any:
    from . import deepspeed as flash_deepspeed  # imported here: hf_trainer never needs DeepSpeed installed

    return flash_deepspeed


def state_files(trainer: Trainer, persist: bool,
                config_files: Callable[[bool], dict[str, FileSpec]]) -> dict[str, FileSpec]:
    """The Trainer's own files of a DeepSpeed snapshot (the engine adds its optimizer and model states);
    ``config_files(refresh)``: what ``Trainer._save`` writes besides the weights."""
    files: dict[str, FileSpec] = {}
    if persist:  # the weights file of a stock checkpoint (a resume reads the engine's files instead)
        files.update(_weights(trainer))
    if trainer.args.should_save:  # config, generation config, tokenizer, training args
        files.update(config_files(persist))
    return files


def _weights(trainer: Trainer) -> dict[str, FileSpec]:
    """The weights ``save_model`` writes under DeepSpeed (ZeRO-3: the gathered 16-bit ones; collective)."""
    if trainer.accelerator.state.deepspeed_plugin.zero_stage != 3:
        return weight_files(trainer) if trainer.args.should_save else {}
    try:
        state_dict = trainer.accelerator.get_state_dict(trainer.deepspeed)
    except ValueError:  # stage3_gather_16bit_weights_on_model_save is off: the stock code writes none
        return {}
    return weight_files(trainer, state_dict) if trainer.args.should_save else {}


def saves_scheduler(trainer: Trainer) -> bool:
    """A Trainer scheduler is ``scheduler.pt``; a DeepSpeed one lives in the engine's files."""
    from accelerate.utils import DeepSpeedSchedulerWrapper

    return not isinstance(trainer.lr_scheduler, DeepSpeedSchedulerWrapper)


def save(trainer: Trainer, ck: Checkpointer, step: int, files: dict[str, Any], persist: bool) -> SaveResult:
    """``engine.save_checkpoint`` through the flash engine into ``ck``, the Trainer's ``files`` in the same step."""
    return _engine_adapter().save_step(trainer.model_wrapped, ck, step, files, persist=persist)


def is_own_file(name: str, files: dict[str, Any]) -> bool:
    """Files each rank keeps on a resume from memory: its RNG state, and the engine's (shared by the engine)."""
    return name.startswith("rng_state") or not isinstance(files[name], (bytes, bytearray))


def resume(trainer: Trainer, ck: Checkpointer, resume_from_checkpoint: str, memory: MemoryResume | None,
           strict: bool) -> None:
    """Load the engine's part of a checkpoint through the flash engine (the stock code would bypass it):
    from ``memory``, the snapshot of ``ck`` that ``resume_from_checkpoint`` stands for, if given."""
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    engine = trainer.model_wrapped
    if memory is not None:
        _engine_adapter().load_step(engine, ck, memory.step, memory.files, load_module_strict=strict)
    else:  # a committed folder: DeepSpeed's loader through the flash engine (or stock, if not ours)
        deepspeed_load_checkpoint(engine, resume_from_checkpoint, load_module_strict=strict)


def load_scheduler(trainer: Trainer, memory: MemoryResume) -> None:
    """The engine restored the optimizer (and its scheduler); a Trainer scheduler is ``scheduler.pt``."""
    from transformers.trainer_pt_utils import reissue_pt_warnings

    scheduler = memory.files.pop(SCHEDULER_NAME, None)
    if scheduler is not None:
        with warnings.catch_warnings(record=True) as caught:
            trainer.lr_scheduler.load_state_dict(scheduler)
        reissue_pt_warnings(caught)


def enable(trainer: Trainer, ck: Checkpointer) -> None:
    """Route the engine's checkpointing through the trainer's checkpointer ``ck`` (collective, first use)."""
    _engine_adapter().ensure_enabled(trainer.model_wrapped, ck)


def finish(trainer: Trainer) -> None:
    """Give the engine its stock checkpointing back, before the trainer's checkpointer closes."""
    _engine_adapter().disable(trainer.model_wrapped, close=False, missing_ok=True)
