"""Full (unsharded) state dicts of FSDP models through flash checkpoints.

```python
from flashckpt_integrations.adapters import fsdp as flash_fsdp

flash_fsdp.save_full(ck, step, model, optimizer)          # collective: gather to rank 0, one memory copy
flash_fsdp.load_full(ck, model, optimizer)                # collective: newest of memory / storage
```

The model and optimizer state are gathered to rank 0 (FSDP1: ``FULL_STATE_DICT`` with
``rank0_only``, offloaded to CPU when the parameters are on an accelerator; FSDP2:
``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True,
cpu_offload=True``). Rank 0 snapshots them; the saver writes, in ``step-<N>/``:

* ``model.safetensors`` (or ``model.pt`` with ``model_file="model.pt"``, e.g. for tied weights): the
  unsharded model's ``state_dict``, loadable by ``safetensors.torch.load_file`` / ``torch.load`` and
  ``nn.Module.load_state_dict`` on the plain model;
* ``optimizer.pt``: the full optimizer state in ``torch.optim.Optimizer.state_dict()`` form (indexed
  in the order of the parameter groups, ``param_names`` in each group), so a plain optimizer over
  the plain model's parameters loads it with ``load_state_dict``.

Loading reads rank 0's files (from memory when every rank holds a newer snapshot than the newest
commit) and scatters the state into the sharded model and optimizer on every rank.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.checkpointer import Checkpointer
from ..core.results import SaveResult
from ..core.state import Codec, FileSpec
from ..errors import FlashCkptError, LayoutMismatchError, missing_dependency
from ._common import check_in, declare_resume, log_save, step_destination
from .dcp import COLLECTIVE_TIMEOUT_S, DcpLoadResult, resolve_step

try:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
except ImportError as exc:  # pragma: no cover - torch built without distributed
    raise missing_dependency("torch.distributed.fsdp", "dcp") from exc

logger = logging.getLogger(__name__)

__all__ = ["MODEL_FILE", "OPTIMIZER_FILE", "full_state_files", "load_full", "save_full"]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


def is_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP1 modules (``FullyShardedDataParallel``), not FSDP2 ones (``fully_shard``)."""
    return any(isinstance(m, FSDP) for m in model.modules())


def gather_full(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """The full model and optimizer state (FQN-keyed) on rank 0; empty dicts on the other ranks."""
    if is_fsdp1(model):
        # offload_to_cpu of parameters that already live on the CPU crashes (torch 2.13): offload only from devices
        offload = any(p.device.type != "cpu" for p in model.parameters())
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True)):
            model_sd = model.state_dict()
            optim_sd = FSDP.optim_state_dict(model, optimizer) if optimizer is not None else None
        return model_sd, optim_sd
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return model_sd, optim_sd


def to_indexed(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """FQN-keyed optimizer state -> ``Optimizer.state_dict()`` form (indices, ``param_names`` per group)."""
    groups, index = [], {}
    for group in optim_sd["param_groups"]:
        names = list(group["params"])
        ids = []
        for name in names:
            index[name] = len(index)
            ids.append(index[name])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids, "param_names": names})
    state = {index[name]: value for name, value in optim_sd["state"].items()}
    return {"state": state, "param_groups": groups}


def to_fqn(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`to_indexed` (needs ``param_names`` in every group)."""
    names: dict[int, str] = {}
    groups = []
    for group in optim_sd["param_groups"]:
        if "param_names" not in group:
            raise LayoutMismatchError("the optimizer file has no param_names; it was not written by save_full")
        names.update(zip(group["params"], group["param_names"]))
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                       "params": list(group["param_names"])})
    return {"state": {names[i]: v for i, v in optim_sd["state"].items()}, "param_groups": groups}


def full_state_files(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_file: str = MODEL_FILE,
    optimizer_file: str = OPTIMIZER_FILE,
) -> dict[str, FileSpec]:
    """Rank 0's files of the full state (``{}`` on other ranks), for ``Checkpointer.save(files=...)``. Collective."""
    model_sd, optim_sd = gather_full(model, optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        return {}
    codec = Codec.SAFETENSORS if model_file.endswith(".safetensors") else Codec.TORCH
    model_sd = {k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    files = {model_file: FileSpec(model_sd, codec, metadata={"format": "pt"} if codec is Codec.SAFETENSORS else None)}
    if optim_sd is not None:
        files[optimizer_file] = FileSpec(to_indexed(optim_sd))
    return files


def save_full(
    checkpointer: Checkpointer,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    persist: bool = True,
    model_file: str = MODEL_FILE,
    optimizer_file: str = OPTIMIZER_FILE,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> SaveResult:
    """Gather the full state to rank 0 and snapshot it (collective); see the module doc.

    Logs once (INFO) how long the whole call (gathering included) held training and where the step lands.
    """
    started = time.perf_counter()
    check_in("save_full", checkpointer.process_group, timeout_s)
    files = full_state_files(model, optimizer, model_file=model_file, optimizer_file=optimizer_file)
    result = checkpointer.save(step, files=files, persist=persist)
    log_save(logger, checkpointer.rank, "FSDP save_full", result, step_destination(checkpointer, step),
             time.perf_counter() - started)
    return result


def load_full(
    checkpointer: Checkpointer,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    prefer_memory: bool = True,
    model_file: str = MODEL_FILE,
    optimizer_file: str = OPTIMIZER_FILE,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> DcpLoadResult | None:
    """Load the newest full-state checkpoint (or ``step``) into the sharded ``model``/``optimizer`` (collective)."""
    ck = checkpointer
    check_in("load_full", ck.process_group, timeout_s)
    chosen = resolve_step(ck, step, prefer_memory=prefer_memory)
    if chosen is None:
        return None
    step, source = chosen
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    if source == "storage":  # read with read_file, not Checkpointer.load: this attempt continues that commit
        declare_resume(ck, step)
    if source == "memory":
        files = ck.load(step, map_location="cpu").files  # collective; rank 0 alone holds files
    elif ck.rank == 0:
        codec = Codec.SAFETENSORS if model_file.endswith(".safetensors") else Codec.TORCH
        files = {model_file: ck.read_file(step, model_file, codec)}
        if optimizer is not None:
            files[optimizer_file] = ck.read_file(step, optimizer_file)
    else:
        files = {}
    if ck.rank == 0:
        if model_file not in files:
            raise FlashCkptError(f"step {step} holds no {model_file}; it was not saved with save_full")
        model_sd = files[model_file]
        if optimizer is not None:
            optim_sd = to_fqn(files[optimizer_file])
    _set_full(model, optimizer, model_sd, optim_sd)
    logger.info("[RANK %d] loaded full state of step %d from %s", ck.rank, step, source)
    return DcpLoadResult(step, source)


def _set_full(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict, optim_sd: dict) -> None:
    """Scatter rank 0's full state into the sharded model and optimizer on every rank."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    if is_fsdp1(model):
        _set_full_fsdp1(model, optimizer, model_sd, optim_sd)
        return
    set_model_state_dict(model, model_sd, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=options)


def _set_full_fsdp1(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict, optim_sd: dict) -> None:
    """FSDP1: every rank needs the full state for ``load_state_dict`` (broadcast from rank 0 first)."""
    shared = [copy.copy(model_sd), optim_sd] if dist.get_rank() == 0 else [None, None]
    dist.broadcast_object_list(shared, src=0)
    model_sd, optim_sd = shared
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        model.load_state_dict(model_sd)
        if optimizer is not None:
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, optim_sd))
