"""Trainer subclasses in :class:`~flashckpt_integrations.adapters.hf_trainer.FlashCkptTrainer`: TRL's
``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, or a user's own ``_save_checkpoint``.

Every snapshot (a checkpoint or a memory-only one) runs the whole ``_save_checkpoint`` chain, so that
what a subclass adds to a checkpoint is in it. One snapshot, in call order:

1. The outermost ``_save_checkpoint`` (the most derived class's, wrapped by :func:`whole_save`) opens
   a :class:`SaveScope`: ``_get_output_dir()`` now names a private scratch folder.
2. Each class runs its part. FlashCkptTrainer's builds the snapshot's own files (weights and optimizer
   state as views of the live tensors, the small files as the stock code writes them) and then calls
   the classes after it, down to ``Trainer._save_checkpoint``, whose writers (``save_model``,
   ``_save_optimizer_and_scheduler``, ``_save_scaler``, ``_save_rng_state``) skip the files the
   snapshot already holds.
3. When the outermost call returns, the live state the stock code touched is put back, and every file
   written into ``<scratch>/checkpoint-N/`` joins the snapshot as a byte file. The core writes and
   commits them with the rest: they are never written into a committed folder.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..core.state import Codec, FileSpec
from ._common import quiet_about

logger = logging.getLogger(__name__)

_WHOLE_SAVE = "_flash_whole_save"


@dataclass
class SaveScope:
    """One snapshot being built by the ``_save_checkpoint`` chain."""

    step: int
    persist: bool
    scratch: str
    """Stands in for ``output_dir`` while the chain runs; removed at the end."""
    folder: str
    """``<scratch>/checkpoint-<step>``: what the classes write there goes into the snapshot."""
    files: dict[str, Any] | None = None
    """FlashCkptTrainer's own files, once its part has run (None: a class did not call ``super()``)."""
    _kept: tuple[Any, Any] | None = None

    @classmethod
    def open(cls, step: int, persist: bool, folder_name: str) -> SaveScope:
        scratch = tempfile.mkdtemp(prefix="flashckpt-checkpoint-")
        folder = os.path.join(scratch, folder_name)
        os.mkdir(folder)  # as save_model makes it: the stock code writes trainer_state.json into it
        return cls(step, persist, scratch, folder)

    def holds(self, path: str | None) -> bool:
        """Whether a stock writer aimed at ``path`` would write what the snapshot already holds."""
        if self.files is None or path is None:
            return False
        path = os.path.abspath(path)
        return path == self.scratch or path.startswith(self.scratch + os.sep)

    def keep(self, state: Any) -> None:
        """Remember the live state that ``Trainer._save_checkpoint`` changes (FlashCkptTrainer has set it)."""
        self._kept = (copy.deepcopy(state.stateful_callbacks), state.best_model_checkpoint)

    def restore(self, state: Any) -> None:
        """Undo the stock code's changes: callback states appended twice, a best checkpoint in scratch."""
        if self._kept is not None:
            state.stateful_callbacks, state.best_model_checkpoint = self._kept

    def written(self) -> dict[str, FileSpec]:
        """The files the classes wrote into the checkpoint folder, as byte files."""
        out: dict[str, FileSpec] = {}
        for path, rel in _walk(self.folder):
            with open(path, "rb") as f:
                out[rel] = FileSpec(f.read(), Codec.BYTES)
        return out

    def outside(self) -> list[str]:
        """Paths (relative to ``output_dir``) the classes wrote beside the checkpoint folder."""
        return [rel for _, rel in _walk(self.scratch) if not _under(os.path.join(self.scratch, rel), self.folder)]

    def move_outside(self, output_dir: str) -> None:
        """Put what was written beside the checkpoint folder where the stock code writes it."""
        for rel in self.outside():
            target = os.path.join(output_dir, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.move(os.path.join(self.scratch, rel), target)

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + os.sep)


def _walk(root: str) -> Iterator[tuple[str, str]]:
    for top, _, names in os.walk(root):
        for name in sorted(names):
            path = os.path.join(top, name)
            yield path, os.path.relpath(path, root).replace(os.sep, "/")


def merge(scope: SaveScope, trainer_cls: type) -> dict[str, Any]:
    """The snapshot's files: FlashCkptTrainer's, plus the ones the classes wrote (those keep their names
    unless FlashCkptTrainer's files have them: ``trainer_state.json`` is the snapshot's)."""
    written = scope.written()
    if scope.files is None:
        _warn_no_super(trainer_cls)
        return written
    files = dict(scope.files)
    for name, spec in written.items():
        if name in files:
            logger.debug("flashckpt: %s written by a subclass's _save_checkpoint is taken from the snapshot", name)
        else:
            files[name] = spec
    return files


_warned_no_super: set[type] = set()


def _warn_no_super(trainer_cls: type) -> None:
    if trainer_cls not in _warned_no_super:
        _warned_no_super.add(trainer_cls)
        logger.warning(
            "flashckpt: %s._save_checkpoint does not call super()._save_checkpoint(): its checkpoint holds the "
            "files it writes, copied as they are (no snapshot of the live tensors). Call super() to get them "
            "from the snapshot.", trainer_cls.__name__)


@contextmanager
def quiet(scope: SaveScope) -> Iterator[None]:
    """Drop log lines of transformers and TRL that name the scratch folder (users never see it)."""
    names = [name for name in list(logging.Logger.manager.loggerDict)
             if name.split(".", 1)[0] in ("transformers", "trl")]
    with quiet_about(scope.scratch, names):
        yield


def whole_save(method: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``method`` (a ``_save_checkpoint``) a whole snapshot when it is the outermost call.

    Outside a snapshot, a supported save (``trial`` None) starts one, which calls the most derived
    ``_save_checkpoint`` again with the scope open; inside, ``method`` runs as written.
    """
    if getattr(method, _WHOLE_SAVE, False):
        return method

    @functools.wraps(method)
    def _save_checkpoint(self: Any, model: Any, trial: Any) -> None:
        if self._flash_scope is None and trial is None and self._flash_unsupported() is None:
            self._flash_snapshot(model, persist=True)
            return None
        return method(self, model, trial)

    setattr(_save_checkpoint, _WHOLE_SAVE, True)
    return _save_checkpoint


def check_bases(cls: type, flash_cls: type, trainer_cls: type) -> None:
    """Refuse a class that puts another ``Trainer`` subclass before FlashCkptTrainer (its ``__init__`` would
    receive FlashCkptTrainer's arguments); make its outermost ``_save_checkpoint`` a whole snapshot."""
    mro = cls.__mro__
    ahead = [c for c in mro[1:mro.index(flash_cls)] if issubclass(c, trainer_cls) and not issubclass(c, flash_cls)]
    if ahead:
        first = [b for b in cls.__bases__ if issubclass(b, flash_cls)]
        others = [b for b in cls.__bases__ if not issubclass(b, flash_cls)]
        order = ", ".join(b.__name__ for b in first + others)
        raise TypeError(
            f"class {cls.__name__} lists {ahead[0].__name__} before {flash_cls.__name__}: "
            f"{ahead[0].__name__}.__init__ would receive {flash_cls.__name__}'s arguments and its checkpoint "
            f"methods would run outside the flash snapshot. List {flash_cls.__name__} first: "
            f"class {cls.__name__}({order}).")
    save = cls._save_checkpoint  # the most derived one: it must open the snapshot
    if not getattr(save, _WHOLE_SAVE, False):
        cls._save_checkpoint = whole_save(save)
