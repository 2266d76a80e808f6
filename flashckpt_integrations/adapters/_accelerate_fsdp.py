"""accelerate's FSDP checkpoint files, from and into a live FSDP model, for whoever holds accelerate's
FSDP plugin (an ``Accelerator``, the HF ``Trainer``'s accelerator).

The files are those ``save_fsdp_model`` / ``save_fsdp_optimizer`` write, built from the same state
dicts, so ``load_fsdp_model`` / ``load_fsdp_optimizer`` (the stock ``load_state`` and ``Trainer``)
read them:

* ``SHARDED_STATE_DICT``: every rank's shards as the DCP folders ``pytorch_model_fsdp_<i>/``
  (``{"model": model state dict}``) and ``optimizer_<i>/`` (``{"optimizer": optimizer state dict}``),
  through the flash DCP layer (:mod:`.dcp`).
* ``FULL_STATE_DICT``: the full state gathered to rank 0 once, as ``pytorch_model_fsdp.bin`` and
  ``optimizer.bin`` (``_<i>`` from the second model on), written by rank 0 only.

Call order: :func:`unsupported` (once, at setup). Saving, on every rank: :func:`sharded_files`, or
:func:`~.fsdp.gather_full` and rank 0's :func:`full_model_file` / :func:`full_optimizer_file`.
Resuming from memory, on every rank: :func:`memory_files` (everything but the DCP folders, which
stay in the slots), then :func:`load_sharded_model` / :func:`load_sharded_optimizer` (items read in
place from the slots), or :func:`require_on_rank0` and :func:`set_full` (rank 0's full state
scattered into the shards). A sharded state saved by another number of ranks
(``reshard.open_sources``): :func:`resharded_files`, then the two loads given those sources.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..core import collectives, reshard
from ..core.checkpointer import Checkpointer
from ..core.codecs import decode_from_slot
from ..core.state import FileSpec
from ..errors import CheckpointNotFoundError, FlashCkptError, missing_dependency
from . import dcp as flash_dcp
from ._common import share_from_rank0
from .fsdp import is_fsdp1

try:
    from accelerate.optimizer import AcceleratedOptimizer
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
    raise missing_dependency("accelerate", "accelerate") from exc

logger = logging.getLogger(__name__)

_NAMES = f"({re.escape(FSDP_MODEL_NAME)}|{re.escape(FSDP_OPTIMIZER_NAME)})"
_DCP_FOLDER = re.compile(rf"{_NAMES}_\d+")
_FULL_FILE = re.compile(rf"{_NAMES}(_\d+)?\.bin")


def model_folder(index: int = 0) -> str:
    """``save_fsdp_model``'s DCP folder of model ``index`` (``SHARDED_STATE_DICT``)."""
    return f"{FSDP_MODEL_NAME}_{index}"


def optimizer_folder(index: int = 0) -> str:
    """``save_fsdp_optimizer``'s DCP folder of optimizer ``index`` (``SHARDED_STATE_DICT``)."""
    return f"{FSDP_OPTIMIZER_NAME}_{index}"


def full_model_file(index: int = 0) -> str:
    """``save_fsdp_model``'s file of model ``index`` (``FULL_STATE_DICT``, rank 0's)."""
    return f"{FSDP_MODEL_NAME}.bin" if index == 0 else f"{FSDP_MODEL_NAME}_{index}.bin"


def full_optimizer_file(index: int = 0) -> str:
    """``save_fsdp_optimizer``'s file of optimizer ``index`` (``FULL_STATE_DICT``, rank 0's)."""
    return f"{FSDP_OPTIMIZER_NAME}.bin" if index == 0 else f"{FSDP_OPTIMIZER_NAME}_{index}.bin"


def is_dcp(path: str) -> bool:
    """Whether ``path`` lies in one of the DCP folders (read in place from the slots on a resume)."""
    return _DCP_FOLDER.fullmatch(path.split("/", 1)[0]) is not None


def is_full_file(path: str) -> bool:
    """Whether ``path`` is one of rank 0's full-state files (scattered, never sent whole to every rank)."""
    return _FULL_FILE.fullmatch(path) is not None


def is_sharded(plugin: Any) -> bool:
    return plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT


def unsupported(plugin: Any) -> str | None:
    """Why this FSDP configuration needs the stock checkpointing, or None."""
    kind = plugin.state_dict_type
    if kind not in (StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT):
        return f"FSDP with {getattr(kind, 'name', kind)}"
    return None


def _context(plugin: Any, model: Any) -> Any:
    """accelerate's state-dict context: FSDP1 switches the model's state-dict type, FSDP2 needs nothing."""
    if plugin.fsdp_version != 1:
        return contextlib.nullcontext()
    return FSDP.state_dict_type(model, plugin.state_dict_type, plugin.state_dict_config,
                                plugin.optim_state_dict_config)


def _options(plugin: Any) -> StateDictOptions | None:
    """The ``StateDictOptions`` accelerate uses for FSDP2 (``None`` for FSDP1), as ``_prepare_sd_options``."""
    if plugin.fsdp_version != 2:
        return None
    return StateDictOptions(
        full_state_dict=plugin.state_dict_type == StateDictType.FULL_STATE_DICT,
        cpu_offload=getattr(plugin.state_dict_config, "offload_to_cpu", False),
        broadcast_from_rank0=getattr(plugin.state_dict_config, "rank0_only", False),
    )


def _plain(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrappers (FSDP2's state-dict calls may step it)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _model_state_dict(plugin: Any, model: Any) -> dict[str, Any]:
    options = _options(plugin)
    return model.state_dict() if options is None else get_model_state_dict(model, options=options)


def _optimizer_state_dict(plugin: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    options = _options(plugin)
    if options is None:
        return FSDP.optim_state_dict(model, optimizer)
    return get_optimizer_state_dict(model, _plain(optimizer), options=options)


# --- saving ----------------------------------------------------------------------------------


def sharded_files(plugin: Any, model: Any, optimizer: Any, group: Any, index: int = 0) -> dict[str, FileSpec]:
    """This rank's shards of model ``index`` (and of its ``optimizer``, unless None) as the two DCP folders
    (collective)."""
    with _context(plugin, model):
        files = flash_dcp.dcp_files({"model": _model_state_dict(plugin, model)}, folder=model_folder(index),
                                    process_group=group)
        if optimizer is not None:
            files.update(flash_dcp.dcp_files({"optimizer": _optimizer_state_dict(plugin, model, optimizer)},
                                             folder=optimizer_folder(index), process_group=group))
    return files


# --- resuming from memory --------------------------------------------------------------------


def memory_files(ck: Checkpointer, step: int, is_own: Callable[[str], bool]) -> dict[str, Any]:
    """The snapshot's files except the DCP folders; rank 0's on every rank except each rank's own
    (``is_own(path)``) and rank 0's full-state files, which stay on rank 0 (collective)."""
    snapshot = ck.memory_snapshots().get(step)
    if snapshot is None:
        raise CheckpointNotFoundError(f"rank {ck.rank} no longer holds step {step} in memory")
    slot, meta = snapshot
    files = {
        f["path"]: decode_from_slot(slot, meta["regions"], f, weights_only=ck.config.weights_only,
                                    map_location="cpu")
        for f in meta["files"] if not is_dcp(f["path"])
    }
    return share_from_rank0(files, ck.rank, is_own=lambda path: is_own(path) or is_full_file(path))


def resharded_files(ck: Checkpointer, sources: reshard.Sources, per_rank: Callable[[str], bool]) -> dict[str, Any]:
    """The snapshot's files except the DCP folders and full-state files, when a job of another number
    of ranks saved it (collective): old rank 0's files on every rank, except the per-rank ones
    (``per_rank(path)``, e.g. RNG states), which each rank takes from the old rank of its own number,
    as a resume from storage reads ``<name>_<rank>`` of its own rank. A WARNING says whose are left."""
    served = {old: {f["path"]: decode_from_slot(slot, meta["regions"], f, weights_only=ck.config.weights_only,
                                                map_location="cpu")
                    for f in meta["files"] if not is_dcp(f["path"]) and not is_full_file(f["path"])
                    and (per_rank(f["path"]) or old == 0)}
              for old, (slot, meta) in sources.slots.items()}
    views: list[Any] = [None] * ck.world_size
    dist.all_gather_object(views, served, group=ck.process_group)  # (objects: pickled, as torch.save wrote them)
    by_old: dict[int, dict[str, Any]] = {}
    for view in views:
        by_old.update(view)
    files = {path: value for path, value in by_old.get(0, {}).items() if not per_rank(path)}
    files.update({path: value for path, value in by_old.get(ck.rank, {}).items() if per_rank(path)})
    old_world = sources.choice.world_size
    kinds = sorted({path for old in by_old.values() for path in old if per_rank(path)})
    if ck.rank == 0 and kinds:
        if old_world > ck.world_size:
            logger.warning("[RANK 0] the per-rank files of old ranks %d-%d (%s ...) are not restored: this job has %d "
                           "ranks, and each rank restores those of its own number, as from storage",
                           ck.world_size, old_world - 1, kinds[-1], ck.world_size)
        elif old_world < ck.world_size:
            logger.warning("[RANK 0] ranks %d-%d have no per-rank files (%s ...) in the snapshot of a job of %d ranks: "
                           "their random states start afresh, as on a resume from storage",
                           old_world, ck.world_size - 1, kinds[0], old_world)
    return files


def load_sharded_model(plugin: Any, ck: Checkpointer, model: Any, step: int, index: int = 0,
                       sources: reshard.Sources | None = None) -> None:
    """Load model ``index`` from its DCP folder in the memory snapshot of ``step``, as ``load_fsdp_model``
    does from storage (collective); ``sources``: the old ranks' snapshots, when another number of
    ranks saved it."""
    with _context(plugin, model):
        state = {"model": _model_state_dict(plugin, model)}
        flash_dcp.load(ck, state, step=step, folder=model_folder(index), sources=sources)
        options = _options(plugin)
        if options is None:
            model.load_state_dict(state["model"])
        else:
            set_model_state_dict(model, state["model"], options=options)


def load_sharded_optimizer(plugin: Any, ck: Checkpointer, model: Any, optimizer: Any, step: int,
                           index: int = 0, sources: reshard.Sources | None = None) -> None:
    """Load ``optimizer`` (of ``model``) from its DCP folder in the memory snapshot of ``step``, as
    ``load_fsdp_optimizer`` does from storage (collective; ``sources`` as for the model)."""
    if plugin.fsdp_version == 1:  # an optimizer that never stepped has no state to load into: make it first,
        _init_state(optimizer)  # or FSDP1's template is empty and nothing of the optimizer is restored
    with _context(plugin, model):
        state = {"optimizer": _optimizer_state_dict(plugin, model, optimizer)}
        flash_dcp.load(ck, state, step=step, folder=optimizer_folder(index), sources=sources)
        if plugin.fsdp_version == 1:
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                model=model, optim=optimizer, optim_state_dict=state["optimizer"]))
        else:
            set_optimizer_state_dict(model, _plain(optimizer), state["optimizer"], options=_options(plugin))


def _init_state(optimizer: Any) -> None:
    """Give every parameter of ``optimizer`` its (zero) state, as torch's own state-dict loading does."""
    try:
        from torch.distributed.checkpoint.state_dict import _init_optim_state
    except ImportError:  # pragma: no cover - torch moved it: FSDP1 then loads into the template it builds
        return
    _init_optim_state(_plain(optimizer))


def require_on_rank0(ck: Checkpointer, obj: Any, step: int, name: str, hint: str) -> None:
    """Raise on every rank (before any rank enters the scatter) when rank 0's snapshot lacks ``name``."""
    if not collectives.all_gather_object(obj is not None, ck.world_size, ck.process_group)[0]:
        raise FlashCkptError(f"the shared-memory snapshot of step {step} holds no {name}, so it cannot be "
                             f"resumed from. {hint}")


def set_full(model: Any, model_sd: dict | None, optimizer: tuple[Any, dict] | None) -> None:
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
        set_optimizer_state_dict(model, _plain(optimizer[0]), optimizer[1], options=options)
