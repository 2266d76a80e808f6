"""FSDP in :class:`~flashckpt_integrations.adapters.hf_trainer.FlashCkptTrainer`: accelerate's checkpoint files.

The files are those the stock ``Trainer`` writes through accelerate's ``save_fsdp_model`` /
``save_fsdp_optimizer`` (and ``save_model``), built from the same state dicts, so the stock
``Trainer`` resumes from them:

* ``SHARDED_STATE_DICT``: every rank snapshots its shard as the DCP folders
  ``pytorch_model_fsdp_0/`` (``{"model": model state dict}``) and ``optimizer_0/``
  (``{"optimizer": optimizer state dict}``), through the flash DCP layer (:mod:`.dcp`).
* ``FULL_STATE_DICT``: rank 0 gathers the full state once and snapshots ``pytorch_model_fsdp.bin``
  (the model state dict), ``optimizer.bin`` (the FQN-keyed optimizer state dict) and, in persisted
  checkpoints, what ``save_model`` writes (``model.safetensors``, ``config.json``, ...).

A resume from memory reads the DCP items straight from the ranks' shared-memory slots, or scatters
rank 0's full state into the sharded model and optimizer; a resume from storage is the stock code.
The files themselves are :mod:`._accelerate_fsdp`'s; this module adds what the Trainer writes beside them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core import reshard
from ..core.checkpointer import Checkpointer
from ..core.state import FileSpec
from . import _accelerate_fsdp as files_of_fsdp
from ._hf_files import weight_files
from .fsdp import gather_full

if TYPE_CHECKING:
    from transformers import Trainer

    from ._hf_resume import MemoryResume

logger = logging.getLogger(__name__)

FULL_MODEL_FILE = files_of_fsdp.full_model_file()
FULL_OPTIMIZER_FILE = files_of_fsdp.full_optimizer_file()
_NOT_RESUMABLE = "It was taken with save_only_model or another FSDP state_dict_type: pass a checkpoint path to " \
    "resume_from_checkpoint."


def _plugin(trainer: Trainer) -> Any:
    return trainer.accelerator.state.fsdp_plugin


def unsupported(trainer: Trainer) -> str | None:
    """Why this FSDP configuration needs the stock checkpointing, or None."""
    return files_of_fsdp.unsupported(_plugin(trainer))


# --- saving ----------------------------------------------------------------------------------


def state_files(trainer: Trainer, ck: Checkpointer, persist: bool,
                config_files: Callable[[bool], dict[str, FileSpec]]) -> dict[str, FileSpec]:
    """This rank's model and optimizer files of a snapshot by ``ck`` (collective). With a full state dict,
    rank 0's include ``config_files(persist)`` (what ``Trainer._save`` writes besides the weights, written
    afresh by a persisting save) and, with ``persist``, the weights ``save_model`` writes."""
    if files_of_fsdp.is_sharded(_plugin(trainer)):  # (Trainer refuses save_only_model with sharded state dicts)
        return files_of_fsdp.sharded_files(_plugin(trainer), trainer.model, trainer.optimizer, ck.process_group)
    return _full_files(trainer, persist, config_files)


def _full_files(trainer: Trainer, persist: bool,
                config_files: Callable[[bool], dict[str, FileSpec]]) -> dict[str, FileSpec]:
    """Rank 0's full-state files (``{}`` on the other ranks); the state is gathered once."""
    optimizer = None if trainer.args.save_only_model else trainer.optimizer
    model_sd, optim_sd = gather_full(trainer.model, optimizer)
    if not trainer.args.should_save:
        return {}
    files: dict[str, FileSpec] = {}
    if persist:  # what save_model writes; memory-only snapshots skip this second copy of the weights
        files.update(weight_files(trainer, model_sd))
    files.update(config_files(persist))
    if optim_sd is not None:
        files[FULL_MODEL_FILE] = FileSpec(model_sd)
        files[FULL_OPTIMIZER_FILE] = FileSpec(optim_sd)
    return files


# --- resuming from memory --------------------------------------------------------------------


def _rank_own(path: str) -> bool:
    """Files each rank keeps for itself: its RNG state, and the weights (rank 0's, never needed elsewhere)."""
    return path.startswith("rng_state") or (path.startswith("model") and path.endswith(".safetensors"))


def memory_files(ck: Checkpointer, step: int) -> dict[str, Any]:
    """The snapshot's files except the DCP folders (read in place when loaded); rank 0's small ones on every rank.

    Collective.
    """
    return files_of_fsdp.memory_files(ck, step, _rank_own)


def resharded_files(trainer: Trainer, ck: Checkpointer) -> Callable[[reshard.Sources], dict[str, Any]] | None:
    """With a sharded state dict: how to read the files of a snapshot that another number of ranks took
    (collective; see ``_accelerate_fsdp.resharded_files``); else None (a full state dict is rank 0's)."""
    if not files_of_fsdp.is_sharded(_plugin(trainer)):
        return None
    return lambda sources: files_of_fsdp.resharded_files(ck, sources, lambda path: path.startswith("rng_state"))


def load_model(trainer: Trainer, ck: Checkpointer, model: Any, memory: MemoryResume) -> None:
    """Load the model from the memory snapshot of ``ck``, as ``load_fsdp_model`` does from a folder (collective)."""
    plugin = _plugin(trainer)
    if files_of_fsdp.is_sharded(plugin):
        files_of_fsdp.load_sharded_model(plugin, ck, model, memory.step, sources=memory.sources)
        return
    model_sd = memory.files.pop(FULL_MODEL_FILE, None)
    files_of_fsdp.require_on_rank0(ck, model_sd, memory.step, FULL_MODEL_FILE, _NOT_RESUMABLE)
    files_of_fsdp.set_full(model, model_sd or {}, None)


def load_optimizer(trainer: Trainer, ck: Checkpointer, memory: MemoryResume) -> None:
    """Load the optimizer from the memory snapshot of ``ck``, as ``load_fsdp_optimizer`` does from a folder
    (collective)."""
    plugin = _plugin(trainer)
    if files_of_fsdp.is_sharded(plugin):
        files_of_fsdp.load_sharded_optimizer(plugin, ck, trainer.model, trainer.optimizer, memory.step,
                                             sources=memory.sources)
        return
    optim_sd = memory.files.pop(FULL_OPTIMIZER_FILE, None)
    files_of_fsdp.require_on_rank0(ck, optim_sd, memory.step, FULL_OPTIMIZER_FILE, _NOT_RESUMABLE)
    files_of_fsdp.set_full(trainer.model, None, (trainer.optimizer, optim_sd or {}))
