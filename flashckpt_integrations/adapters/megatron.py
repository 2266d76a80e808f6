"""Flash checkpoints for Megatron-LM: one import and one call, and ``save_checkpoint`` /
``load_checkpoint`` go through shared memory and the node's saver, in Megatron's own layout.

```python
from flashckpt_integrations.adapters import megatron as flash_megatron

flash = flash_megatron.patch(persist_interval=100)   # on every rank, before pretrain() or your loop
...                                                  # --save-interval 10: memory every 10 iterations,
flash.close()                                        # storage every 100; close(): wait, free memory
```

* ``megatron.training.checkpointing.save_checkpoint`` (and every module that imported it, such as
  ``megatron.training.training``) runs Megatron's own code to build each rank's state; the files
  it would write (``iter_XXXXXXX/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt``, the distributed
  optimizer's ``distrib_optim.pt``) are copied into the rank's shared-memory slot instead, and the
  call returns. The node's saver writes them, byte-compatible with ``torch.save``; the committer
  renames the iteration's folder into place and writes ``latest_checkpointed_iteration.txt`` only
  once every rank's files are durable, so unpatched Megatron reads the result and never sees a
  partial iteration.
* Saves whose iteration is not a multiple of ``persist_interval``, and Megatron's non-persistent
  saves (``--non-persistent-save-interval``), stay in memory only: one memory copy, and they
  survive the death of the training processes.
* ``load_checkpoint`` loads the newest iteration that every rank holds complete in memory, when
  it is at least as new as the newest commit and was saved with the same parallel layout (files
  that only another rank's slot holds are sent over a gloo group); else Megatron's own code loads
  the newest commit from storage. A storage checkpoint saved with other tensor, pipeline or expert
  parallel sizes fails up front with the sizes that differ.
* Configurations outside this (``--ckpt-format`` other than ``torch``, release checkpoints,
  explicit rank overrides, the layer-wise distributed optimizer) use Megatron's stock code, with a
  warning. For ``torch_dist`` checkpoints see :mod:`.megatron_core`.

Supported: Megatron-LM's ``megatron.training`` as shipped with megatron-core 0.19 (Python >= 3.12).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..config import CheckpointerConfig
from ..core.engine import Checkpointer
from ..core.layout import Layout
from ..core.results import PersistResult, SaveResult
from ..errors import FlashCkptError, LayoutMismatchError, missing_dependency
from ._common import declare_resume, log_save, newest_memory_step
from ._transfer import exchange, gloo_group

try:
    from megatron.core import mpu
    from megatron.core import package_info as _package_info
    from megatron.core.optimizer import distrib_optimizer as _distrib_optimizer
    from megatron.training import checkpointing as _checkpointing
    from megatron.training.global_vars import get_args
except ImportError as exc:  # pragma: no cover - exercised only without megatron
    raise missing_dependency("megatron.training (megatron-core >= 0.19, Python >= 3.12)", "megatron") from exc

logger = logging.getLogger(__name__)

__all__ = ["LAYOUT", "SUPPORTED_VERSIONS", "MegatronFlash", "patch", "unpatch"]

SUPPORTED_VERSIONS = ("0.19",)
"""megatron-core release lines whose ``megatron.training.checkpointing`` this patch was built against."""
TRACKER = "latest_checkpointed_iteration.txt"
LAYOUT = Layout(step_dir="iter_{step:07d}", tracker=TRACKER, tracker_content="{step}", staging=True)
"""Megatron's ``iter_XXXXXXX/`` folders and tracker; the folder appears at commit."""
_SIZES = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "expert_model_parallel_size": "ep", "context_parallel_size": "cp", "data_parallel_size": "dp",
    "world_size": "world",
}
_FILE_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")
"""The sizes that name a legacy checkpoint's files: a load with other values cannot find them."""

_active: MegatronFlash | None = None


class _TorchProxy(types.ModuleType):
    """``torch`` as Megatron's checkpointing modules see it while patched.

    ``save`` of a path inside the iteration being saved is captured for the snapshot, and ``load``
    of a path inside the iteration being served from memory returns the snapshot's object;
    everything else is torch itself.
    """

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        io = _active._io if _active is not None else None
        if io is not None and io.capture(obj, f):
            return None
        return torch.save(obj, f, *args, **kwargs)

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        io = _active._io if _active is not None else None
        if io is not None and (found := io.serve(f)) is not None:
            return found
        return torch.load(f, *args, **kwargs)


class _Files:
    """The files of one iteration, captured from a save or served to a load (absolute paths)."""

    def __init__(self, step_dir: str, served: Mapping[str, Any] | None = None) -> None:
        self.step_dir = step_dir
        self.files: dict[str, Any] = dict(served or {})
        self.serving = served is not None

    def _inside(self, f: Any) -> str | None:
        if not isinstance(f, (str, os.PathLike)):
            return None
        path = os.path.abspath(os.fspath(f))
        return path if path.startswith(self.step_dir + os.sep) else None

    def capture(self, obj: Any, f: Any) -> bool:
        path = None if self.serving else self._inside(f)
        if path is not None:
            self.files[path] = obj
        return path is not None

    def serve(self, f: Any) -> Any:
        path = self._inside(f) if self.serving else None
        return self.files.pop(path, None) if path is not None else None


@dataclasses.dataclass
class MegatronFlash:
    """What :func:`patch` installed: the checkpointers (one per checkpoint directory) and the outcomes.

    ``last_save`` is the :class:`~flashckpt_integrations.SaveResult` of the newest save, and
    ``last_load`` is ``(iteration, "memory" | "storage")`` of the newest load (``None``: nothing
    was loaded).
    """

    persist_interval: int | None = 1
    config: CheckpointerConfig = dataclasses.field(default_factory=lambda: CheckpointerConfig(layout=LAYOUT))
    last_save: SaveResult | None = None
    last_load: tuple[int, str] | None = None
    _checkpointers: dict[str, Checkpointer] = dataclasses.field(default_factory=dict)
    _io: _Files | None = None
    _originals: dict[str, Any] = dataclasses.field(default_factory=dict)
    _replaced: list[tuple[Any, str, Any]] = dataclasses.field(default_factory=list)
    _warned: set[str] = dataclasses.field(default_factory=set)
    _attached: set[int] = dataclasses.field(default_factory=set)
    _transfer_group: Any = None

    def checkpointer(self, directory: str | os.PathLike) -> Checkpointer:
        """The checkpointer of a checkpoint directory (``--save`` / ``--load``), made on first use."""
        root = os.path.abspath(os.fspath(directory))
        if root not in self._checkpointers:
            self._checkpointers[root] = Checkpointer(root, self.config)
        return self._checkpointers[root]

    def wait(self) -> PersistResult | None:
        """Wait until every persisting save is committed (or failed); the newest outcome."""
        outcomes = [ck.wait() for ck in self._checkpointers.values()]
        return next((o for o in reversed(outcomes) if o is not None), None)

    def close(self) -> None:
        """Wait for in-flight persisting and free the shared memory (the end of a normal run)."""
        for ck in self._checkpointers.values():
            ck.close()
        self._checkpointers.clear()

    # --- save ------------------------------------------------------------------------------

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        original = self._originals["save_checkpoint"]
        call = inspect.signature(original).bind(*args, **kwargs)
        margs = get_args()
        reason = _unsupported_save(margs, call.arguments)
        if reason is not None:
            self._warn(reason)
            return original(*args, **kwargs)
        iteration = int(call.arguments["iteration"])
        memory_only = bool(call.arguments.pop("non_persistent_ckpt", False))
        persist = not memory_only and self.persist_interval is not None and iteration % self.persist_interval == 0
        ck = self.checkpointer(margs.save)
        self._attach(ck, call.arguments.get("optimizer"))
        files = self._capture(ck, iteration, original, call)
        self.last_save = ck.save(iteration, files=files, persist=persist,
                                 metadata={"megatron": _parallel_sizes(margs)})
        log_save(logger, ck.rank, "Megatron save_checkpoint", self.last_save,
                 os.path.join(ck.url, LAYOUT.step_path(iteration)), time.perf_counter() - started)

    def _attach(self, ck: Checkpointer, optimizer: Any) -> None:
        """With ``async_snapshot``, make the torch optimizers inside Megatron's wait for the overlapped copy."""
        if not ck.config.async_snapshot or optimizer is None or id(optimizer) in self._attached:
            return
        self._attached.add(id(optimizer))
        for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            inner = getattr(part, "optimizer", None)
            if isinstance(inner, torch.optim.Optimizer):
                ck.attach_optimizer(inner)

    def _capture(self, ck: Checkpointer, iteration: int, original: Any, call: inspect.BoundArguments) -> dict[str, Any]:
        """Run Megatron's save with its file writes captured; the files relative to the iteration's folder."""
        step_dir = os.path.join(ck.url, LAYOUT.step_path(iteration))
        margs = get_args()
        scratch = tempfile.mkdtemp(prefix="flashckpt-megatron-")
        try:
            with self._io_of(_Files(step_dir)) as io, _swapped(
                _checkpointing,
                ensure_directory_exists=_skip_inside(step_dir, _checkpointing.ensure_directory_exists),
                get_checkpoint_tracker_filename=lambda _: os.path.join(scratch, TRACKER),  # the committer writes it
            ), _swapped(margs, async_save=False):  # the saver is the asynchronous part
                original(*call.args, **call.kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {os.path.relpath(path, step_dir).replace(os.sep, "/"): obj for path, obj in io.files.items()}

    # --- load ------------------------------------------------------------------------------

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["load_checkpoint"]
        call = inspect.signature(original).bind(*args, **kwargs)
        call.apply_defaults()
        margs = get_args()
        load_dir = getattr(margs, call.arguments["load_arg"], None)
        reason = _unsupported_load(margs, load_dir)
        if reason is not None:
            self._warn(reason)
            return original(*args, **kwargs)
        ck = self.checkpointer(load_dir)
        step = self._memory_step(ck, _parallel_sizes(margs))
        if step is None:
            _check_storage_layout(margs, load_dir)
            result = original(*args, **kwargs)
            iteration = result[0] if isinstance(result, tuple) else result
            self.last_load = (int(iteration), "storage") if iteration else None
            if iteration and margs.save and os.path.abspath(margs.save) == os.path.abspath(load_dir):
                declare_resume(ck, int(iteration))  # Megatron's own loader read it: saves continue its lineage
            return result
        with self._serving(ck, step, load_dir):
            result = original(*args, **kwargs)
        self.last_load = (step, "memory")
        logger.warning("[RANK %d] flashckpt: resumed iteration %d from shared memory", ck.rank, step)
        return result

    def _memory_step(self, ck: Checkpointer, sizes: dict[str, int]) -> int | None:
        """The iteration to load from memory (collective): held complete by every rank, saved with
        this run's parallel sizes, and at least as new as the newest commit; else None."""
        matching, other = [], {}
        for step, (_, meta) in ck._memory_snapshots().items():
            saved = meta.get("user", {}).get("megatron")
            if saved == sizes:
                matching.append(step)
            else:
                other[step] = saved
        step = newest_memory_step(ck, matching)
        if step is None and other:
            committed = ck.committed_steps()
            skipped = [s for s in other if not committed or s >= committed[-1]]
            if skipped:
                logger.warning("[RANK %d] flashckpt: the memory snapshots of iterations %s were saved with parallel "
                               "sizes %s, this run has %s; loading from storage", ck.rank, sorted(skipped),
                               other[max(skipped)], sizes)
        return step

    @contextlib.contextmanager
    def _serving(self, ck: Checkpointer, step: int, load_dir: str) -> Iterator[None]:
        """Let Megatron's stock load code read iteration ``step`` from the ranks' memory snapshots."""
        result = ck.load(step, map_location="cpu")
        if result is None or result.source != "memory":
            raise FlashCkptError(f"the memory snapshot of iteration {step} vanished while it was being loaded")
        step_dir = os.path.join(ck.url, LAYOUT.step_path(step))
        own = {os.path.join(step_dir, rel): obj for rel, obj in result.files.items()}
        if self._transfer_group is None:
            self._transfer_group = gloo_group()
        served = {**own, **exchange(own, _needed_files(get_args(), ck.url, step), ck.rank, ck.world_size,
                                    ck.process_group, self._transfer_group)}
        scratch = tempfile.mkdtemp(prefix="flashckpt-megatron-")
        tracker = os.path.join(scratch, TRACKER)
        with open(tracker, "w") as f:
            f.write(str(step))
        try:
            with self._io_of(_Files(step_dir, served)), _swapped(
                _checkpointing,
                get_checkpoint_tracker_filename=lambda _: tracker,
                _get_checkpoint_format=_format_of(step_dir, _checkpointing._get_checkpoint_format),
            ):
                yield
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # --- patching ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _io_of(self, files: _Files) -> Iterator[_Files]:
        self._io = files
        try:
            yield files
        finally:
            self._io = None

    def _install(self) -> None:
        for name in ("save_checkpoint", "load_checkpoint"):
            original = getattr(_checkpointing, name)
            self._originals[name] = original
            wrapper = functools.update_wrapper(_forwarding(getattr(self, name)), original)
            for module in list(sys.modules.values()):  # `from ...checkpointing import save_checkpoint` too
                if getattr(module, name, None) is original:
                    self._replaced.append((module, name, original))
                    setattr(module, name, wrapper)
        proxy = _TorchProxy()
        for module in (_checkpointing, _distrib_optimizer):
            self._replaced.append((module, "torch", module.torch))
            module.torch = proxy

    def _uninstall(self) -> None:
        for module, name, original in reversed(self._replaced):
            setattr(module, name, original)
        self._replaced.clear()

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("flashckpt: %s is not supported by the Megatron patch; Megatron's stock checkpointing "
                           "is used (no shared memory, no background saving)", reason)


def patch(*, persist_interval: int | None = 1,
          config: CheckpointerConfig | Mapping[str, Any] | None = None) -> MegatronFlash:
    """Route Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` through flash checkpoints (every rank).

    ``persist_interval``: iterations that are a multiple of it are persisted, the others stay in
    memory only (``None``: persist none; ``1``: persist every save). ``config``: a
    :class:`~flashckpt_integrations.CheckpointerConfig` or a dict of its fields (``retention``,
    ``async_snapshot``, ...); the layout is always Megatron's.
    """
    global _active
    _check_version()
    if persist_interval is not None and (isinstance(persist_interval, bool) or not isinstance(persist_interval, int)
                                         or persist_interval < 1):
        raise ValueError(f"persist_interval={persist_interval!r} must be a positive number of iterations or None")
    if _active is not None:
        raise FlashCkptError("Megatron is patched already; call flash_megatron.unpatch() before patching again")
    if isinstance(config, CheckpointerConfig):
        fields = dataclasses.asdict(config)
    elif config is None or isinstance(config, Mapping):
        fields = dict(config or {})
        if "layout" in fields:
            raise ValueError("config must not set 'layout': the patch writes Megatron's own iter_XXXXXXX folders")
    else:
        raise TypeError(f"config must be a CheckpointerConfig or a dict of its fields, got {type(config)}")
    fields["layout"] = LAYOUT
    flash = MegatronFlash(persist_interval=persist_interval, config=CheckpointerConfig(**fields))
    flash._install()
    _active = flash
    return flash


def unpatch(*, close: bool = True) -> None:
    """Restore Megatron's stock functions; with ``close`` wait for persisting and free the memory."""
    global _active
    flash, _active = _active, None
    if flash is not None:
        flash._uninstall()
        if close:
            flash.close()


# --- helpers ---------------------------------------------------------------------------------


def _check_version() -> None:
    version = getattr(_package_info, "__version__", "unknown")
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VERSIONS):
        raise FlashCkptError(
            f"megatron-core {version} is not supported by the Megatron patch; supported releases: "
            f"{', '.join(v + '.x' for v in SUPPORTED_VERSIONS)}. Install one of them "
            "(pip install 'megatron-core==0.19.*'), or use Megatron's stock checkpointing."
        )
    for name in ("save_checkpoint", "load_checkpoint", "get_checkpoint_name", "_get_checkpoint_format",
                 "get_checkpoint_tracker_filename", "ensure_directory_exists"):
        if not callable(getattr(_checkpointing, name, None)):
            raise FlashCkptError(f"megatron.training.checkpointing has no {name}(); this Megatron-LM build is not "
                                 f"one the patch supports ({', '.join(SUPPORTED_VERSIONS)})")


def _unsupported_save(margs: Any, arguments: Mapping[str, Any]) -> str | None:
    if margs.save is None:
        return "saving without --save"
    if margs.ckpt_format != "torch":
        return f"--ckpt-format {margs.ckpt_format}"
    if arguments.get("release"):
        return "a release checkpoint"
    if any(arguments.get(k) is not None for k in ("pipeline_rank", "expert_rank", "tensor_rank", "pipeline_parallel",
                                                  "expert_parallel")):
        return "save_checkpoint with explicit rank overrides"
    if getattr(margs, "use_layer_wise_distributed_optimizer", False):
        return "the layer-wise distributed optimizer"
    return None


def _unsupported_load(margs: Any, load_dir: str | None) -> str | None:
    if load_dir is None:
        return "loading without --load"
    if margs.ckpt_format != "torch":
        return f"--ckpt-format {margs.ckpt_format}"
    if getattr(margs, "use_layer_wise_distributed_optimizer", False):
        return "the layer-wise distributed optimizer"
    if getattr(margs, "ckpt_step", None) or getattr(margs, "finetune", False):
        return "--ckpt-step / --finetune"
    return None


def _parallel_sizes(margs: Any) -> dict[str, int]:
    return {short: int(getattr(margs, name, 1) or 1) for name, short in _SIZES.items()}


def _needed_files(margs: Any, root: str, step: int) -> list[str]:
    """The files Megatron's legacy load reads on this rank (absolute paths)."""
    model = os.path.abspath(_checkpointing.get_checkpoint_name(root, step))
    needed = [model]
    if margs.use_distributed_optimizer and not margs.no_load_optim and mpu.get_data_parallel_rank() == 0:
        needed.append(_checkpointing.get_distributed_optimizer_checkpoint_name(model))
    return needed


def _check_storage_layout(margs: Any, load_dir: str) -> None:
    """Fail before Megatron does (with a missing file or an assert) when the saved sizes differ."""
    tracker = _checkpointing.get_checkpoint_tracker_filename(load_dir)
    try:
        with open(tracker) as f:
            iteration = int(f.read().strip())
    except (OSError, ValueError):
        return  # no checkpoint, or a release one: Megatron's code decides
    path = _checkpointing.find_checkpoint_rank_0(load_dir, iteration)
    if path is None:
        return
    state = torch.load(path, map_location="cpu", mmap=True)
    saved = state.get("args") if isinstance(state, dict) else None
    if saved is None:
        return
    differ = [f"{name} {getattr(saved, name, 1)} (this run {getattr(margs, name, 1)})" for name in _FILE_SIZES
              if int(getattr(saved, name, 1) or 1) != int(getattr(margs, name, 1) or 1)]
    if differ:
        raise LayoutMismatchError(
            f"iteration {iteration} in {load_dir} was saved with other parallel sizes: {', '.join(differ)}. The torch "
            "checkpoint format stores one file per model-parallel rank and cannot be resharded on load: relaunch "
            "with the saved sizes, or convert the checkpoint with Megatron's checkpoint converter first."
        )


def _forwarding(method: Any) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)
    return forward


def _skip_inside(step_dir: str, ensure: Any) -> Any:
    def ensure_directory_exists(filename: str, check_parent: bool = True) -> None:
        if not os.path.abspath(filename).startswith(step_dir + os.sep):  # the saver makes the iteration's folders
            ensure(filename, check_parent)
    return ensure_directory_exists


def _format_of(step_dir: str, detect: Any) -> Any:
    def get_checkpoint_format(checkpoint_name: str, args: Any) -> str:
        return "torch" if os.path.abspath(checkpoint_name) == step_dir else detect(checkpoint_name, args)
    return get_checkpoint_format


@contextlib.contextmanager
def _swapped(module: Any, **attributes: Any) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in attributes}
    for name, value in attributes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
