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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..core import collectives
from ..core.checkpointer import Checkpointer
from ..core.codecs import decode_from_slot
from ..core.state import FileSpec
from ..errors import CheckpointNotFoundError, FlashCkptError, missing_dependency
from . import dcp as flash_dcp
from ._common import share_from_rank0
from ._hf_files import weight_files
from .fsdp import gather_full, is_fsdp1

try:
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from accelerate.utils.constants import OPTIMIZER_NAME as FSDP_OPTIMIZER_NAME
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
except ImportError as exc:  # pragma: no cover - exercised only without accelerate
    raise missing_dependency("accelerate", "hf") from exc

if TYPE_CHECKING:
    from transformers import Trainer

    from ._hf_resume import MemoryResume

logger = logging.getLogger(__name__)

MODEL_FOLDER = f"{FSDP_MODEL_NAME}_0"
"""``save_fsdp_model``'s DCP folder (``SHARDED_STATE_DICT``, model index 0)."""
OPTIMIZER_FOLDER = f"{FSDP_OPTIMIZER_NAME}_0"
"""``save_fsdp_optimizer``'s DCP folder (``SHARDED_STATE_DICT``, optimizer index 0)."""
FULL_MODEL_FILE = f"{FSDP_MODEL_NAME}.bin"
"""``save_fsdp_model``'s file (``FULL_STATE_DICT``, written by rank 0)."""
FULL_OPTIMIZER_FILE = f"{FSDP_OPTIMIZER_NAME}.bin"
"""``save_fsdp_optimizer``'s file (``FULL_STATE_DICT``, written by rank 0)."""


def _plugin(trainer: Trainer) -> Any:
    return trainer.accelerator.state.fsdp_plugin


def _is_sharded(trainer: Trainer) -> bool:
    return _plugin(trainer).state_dict_type == StateDictType.SHARDED_STATE_DICT


def unsupported(trainer: Trainer) -> str | None:
    """Why this FSDP configuration needs the stock checkpointing, or None."""
    kind = _plugin(trainer).state_dict_type
    if kind not in (StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT):
        return f"FSDP with {getattr(kind, 'name', kind)}"
    return None


def _context(trainer: Trainer, model: Any) -> Any:
    """accelerate's state-dict context: FSDP1 switches the model's state-dict type, FSDP2 needs nothing."""
    plugin = _plugin(trainer)
    if plugin.fsdp_version != 1:
        return contextlib.nullcontext()
    return FSDP.state_dict_type(model, plugin.state_dict_type, plugin.state_dict_config,
                                plugin.optim_state_dict_config)


def _options(trainer: Trainer) -> StateDictOptions | None:
    """The ``StateDictOptions`` accelerate uses for FSDP2 (``None`` for FSDP1), as ``_prepare_sd_options``."""
    plugin = _plugin(trainer)
    if plugin.fsdp_version != 2:
        return None
    return StateDictOptions(
        full_state_dict=plugin.state_dict_type == StateDictType.FULL_STATE_DICT,
        cpu_offload=getattr(plugin.state_dict_config, "offload_to_cpu", False),
        broadcast_from_rank0=getattr(plugin.state_dict_config, "rank0_only", False),
    )


def _model_state_dict(trainer: Trainer, model: Any) -> dict[str, Any]:
    """The model state dict ``save_fsdp_model`` / ``load_fsdp_model`` use (inside :func:`_context`)."""
    options = _options(trainer)
    return model.state_dict() if options is None else get_model_state_dict(model, options=options)


def _optimizer_state_dict(trainer: Trainer, model: Any) -> dict[str, Any]:
    """The optimizer state dict ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` use (inside :func:`_context`)."""
    options = _options(trainer)
    if options is None:
        return FSDP.optim_state_dict(model, trainer.optimizer)
    return get_optimizer_state_dict(model, trainer.optimizer, options=options)


# --- saving ----------------------------------------------------------------------------------


def state_files(trainer: Trainer, ck: Checkpointer, persist: bool,
                config_files: Callable[[bool], dict[str, FileSpec]]) -> dict[str, FileSpec]:
    """This rank's model and optimizer files of a snapshot by ``ck`` (collective). With a full state dict,
    rank 0's include ``config_files(persist)`` (what ``Trainer._save`` writes besides the weights, written
    afresh by a persisting save) and, with ``persist``, the weights ``save_model`` writes."""
    if _is_sharded(trainer):
        return _sharded_files(trainer, ck.process_group)
    return _full_files(trainer, persist, config_files)


def _sharded_files(trainer: Trainer, group: Any) -> dict[str, FileSpec]:
    """The two DCP folders of this rank's shards (Trainer refuses save_only_model with sharded state dicts)."""
    model = trainer.model
    with _context(trainer, model):
        files = flash_dcp.dcp_files({"model": _model_state_dict(trainer, model)}, folder=MODEL_FOLDER,
                                    process_group=group)
        files.update(flash_dcp.dcp_files({"optimizer": _optimizer_state_dict(trainer, model)},
                                         folder=OPTIMIZER_FOLDER, process_group=group))
    return files


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


def _is_dcp(path: str) -> bool:
    return path.split("/", 1)[0] in (MODEL_FOLDER, OPTIMIZER_FOLDER)


def _rank_own(path: str) -> bool:
    """Files each rank keeps for itself: its RNG state, and rank 0's full state (scattered when loaded)."""
    return path.startswith("rng_state") or path in (FULL_MODEL_FILE, FULL_OPTIMIZER_FILE) or (
        path.startswith("model") and path.endswith(".safetensors"))


def memory_files(ck: Checkpointer, step: int) -> dict[str, Any]:
    """The snapshot's files except the DCP folders (read in place when loaded); rank 0's small ones on every rank.

    Collective.
    """
    snapshot = ck.memory_snapshots().get(step)
    if snapshot is None:
        raise CheckpointNotFoundError(f"rank {ck.rank} no longer holds step {step} in memory")
    slot, meta = snapshot
    files = {
        f["path"]: decode_from_slot(slot, meta["regions"], f, weights_only=ck.config.weights_only,
                                    map_location="cpu")
        for f in meta["files"] if not _is_dcp(f["path"])
    }
    return share_from_rank0(files, ck.rank, is_own=_rank_own)


def load_model(trainer: Trainer, ck: Checkpointer, model: Any, memory: MemoryResume) -> None:
    """Load the model from the memory snapshot of ``ck``, as ``load_fsdp_model`` does from a folder (collective)."""
    if _is_sharded(trainer):
        with _context(trainer, model):
            state = {"model": _model_state_dict(trainer, model)}
            flash_dcp.load(ck, state, step=memory.step, folder=MODEL_FOLDER)
            _set_model(trainer, model, state["model"])
        return
    model_sd = memory.files.pop(FULL_MODEL_FILE, None)
    _require_on_rank0(ck, model_sd, memory.step, FULL_MODEL_FILE)
    _set_full(model, model_sd or {}, None)


def load_optimizer(trainer: Trainer, ck: Checkpointer, memory: MemoryResume) -> None:
    """Load the optimizer from the memory snapshot of ``ck``, as ``load_fsdp_optimizer`` does from a folder
    (collective)."""
    model = trainer.model
    if _is_sharded(trainer):
        with _context(trainer, model):
            state = {"optimizer": _optimizer_state_dict(trainer, model)}
            flash_dcp.load(ck, state, step=memory.step, folder=OPTIMIZER_FOLDER)
            if _plugin(trainer).fsdp_version == 1:
                trainer.optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                    model=model, optim=trainer.optimizer, optim_state_dict=state["optimizer"]))
            else:
                set_optimizer_state_dict(model, trainer.optimizer, state["optimizer"], options=_options(trainer))
        return
    optim_sd = memory.files.pop(FULL_OPTIMIZER_FILE, None)
    _require_on_rank0(ck, optim_sd, memory.step, FULL_OPTIMIZER_FILE)
    _set_full(model, None, (trainer.optimizer, optim_sd or {}))


def _set_model(trainer: Trainer, model: Any, state_dict: dict[str, Any]) -> None:
    options = _options(trainer)
    if options is None:
        model.load_state_dict(state_dict)
    else:
        set_model_state_dict(model, state_dict, options=options)


def _require_on_rank0(ck: Checkpointer, obj: Any, step: int, name: str) -> None:
    """Raise on every rank (before any rank enters the scatter) when rank 0's snapshot lacks ``name``."""
    if not collectives.all_gather_object(obj is not None, ck.world_size, ck.process_group)[0]:
        raise FlashCkptError(
            f"the shared-memory snapshot of step {step} holds no {name} (taken with save_only_model or another FSDP "
            "state_dict_type), so it cannot be resumed from. Pass a checkpoint path to resume_from_checkpoint.")


def _set_full(model: Any, model_sd: dict | None, optimizer: tuple[Any, dict] | None) -> None:
    """Scatter rank 0's full model or optimizer state into the sharded model / optimizer (collective)."""
    if is_fsdp1(model):  # FSDP1 loads a full state dict on every rank: rank 0 sends it
        shared = [model_sd, optimizer[1] if optimizer else None] if dist.get_rank() == 0 else [None, None]
        dist.broadcast_object_list(shared, src=0)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            if model_sd is not None:
                model.load_state_dict(shared[0])
            if optimizer is not None:
                optimizer[0].load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer[0], shared[1]))
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if model_sd is not None:
        set_model_state_dict(model, model_sd, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer[0], optimizer[1], options=options)
