"""Where a :class:`~flashckpt_integrations.adapters.hf_trainer.FlashCkptTrainer` resumes from.

``resume_from_checkpoint=True`` (:func:`resume_latest`): the newest complete snapshot that every
rank holds in shared memory, when it is at least as new as the newest commit; else the newest
committed checkpoint; else a start from scratch. A snapshot resumed from memory is a
:class:`MemoryResume`: its small files (``trainer_state.json``, RNG states, ...) are laid out in a
private folder that the stock resume code reads, and the trainer's loading methods take the
model, optimizer and scheduler states from its objects when they are given that folder.
``None`` (:func:`start_from_scratch`) and an explicit path (:func:`resume_from_path`) are resumed
by the stock code; a warning says what they leave unused.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core import reshard
from ..core.checkpointer import Checkpointer
from ..errors import FlashCkptError, missing_dependency
from ._common import newest_memory_step, resharding_sources, write_byte_files
from ._hf_files import TRAINER_STATE_NAME

try:
    from transformers import TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise missing_dependency("transformers", "hf") from exc

logger = logging.getLogger(__name__)

_RESUME_LATEST = {"true", "latest", "yes", "1"}
_RESUME_NONE = {"false", "none", "no", "0", ""}


@dataclass
class MemoryResume:
    """A snapshot being resumed from memory: its step, the folder of its small files, its objects."""

    step: int
    path: str
    files: dict[str, Any]
    sources: reshard.Sources | None = None
    """The old ranks' snapshots, when a job of another number of ranks took it."""

    def close(self) -> None:
        """Remove the folder of its small files (and unmap the old ranks' snapshots)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.sources is not None:
            self.sources.close()


def resume_flag(value: Any) -> Any:
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


def checkpoint_step(path: str) -> int | None:
    """The step in a ``checkpoint-<N>`` path, or None."""
    tail = os.path.basename(os.path.normpath(path)).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def resume_latest(
    ck: Checkpointer, args: TrainingArguments, memory_files: Callable[[int], dict[str, Any]],
    resharded_files: Callable[[reshard.Sources], dict[str, Any]] | None = None,
) -> tuple[str | bool | None, MemoryResume | None, tuple[int, str] | None]:
    """What ``resume_from_checkpoint=True`` means: memory snapshot, else newest commit (collective).

    ``memory_files(step)``: the files of the memory snapshot of ``step`` (collective).
    ``resharded_files(sources)``: where the state reshards (FSDP's sharded state dict), the files of
    a snapshot that a job of another number of ranks left in memory (collective); it is resumed
    from when this job's own memory holds no step at least as new as the newest commit. Returns the
    ``resume_from_checkpoint`` to give the stock ``train`` (a folder, ``True`` for a checkpoint only
    the stock lookup finds, ``None`` for none), the snapshot resumed from memory (or None), and
    ``(step, "memory" | "storage")`` (or None).
    """
    step = newest_memory_step(ck)
    if step is not None:
        files = memory_files(step)
        if TRAINER_STATE_NAME not in files:
            raise FlashCkptError(
                f"the shared-memory snapshot of step {step} holds no {TRAINER_STATE_NAME}; it was not taken "
                "by FlashCkptTrainer. Remove it with `flashckpt clean <output_dir>` or pass a checkpoint path."
            )
        # trainer_state.json, rng_state*.pth, config.json, ...: read by the stock resume code
        path = write_byte_files(files, prefix=f"flashckpt-memory-{PREFIX_CHECKPOINT_DIR}-{step}-")
        memory = MemoryResume(step, path, files)
        ck.start_attempt(step, from_memory=True)  # (FSDP's and DeepSpeed's files come without ck.load)
        logger.warning("flashckpt: resuming from the shared-memory snapshot of step %d", step)
        return path, memory, (step, "memory")
    committed = ck.committed_steps()
    resharded = _resharded(ck, committed, resharded_files)
    if resharded is not None:
        return resharded.path, resharded, (resharded.step, "memory")
    if committed:
        ck.start_attempt(committed[-1])  # this run continues the one that committed it
        logger.warning("flashckpt: resuming from committed checkpoint %d", committed[-1])
        return os.path.join(args.output_dir, ck.layout.step_path(committed[-1])), None, (committed[-1], "storage")
    ck.start_attempt(None)
    if os.path.isdir(args.output_dir) and get_last_checkpoint(args.output_dir) is not None:
        return True, None, None  # a checkpoint written by a plain Trainer: the stock lookup finds it
    logger.warning("flashckpt: no snapshot in memory and no checkpoint in %s; training starts from scratch",
                   args.output_dir)
    return None, None, None


def _resharded(ck: Checkpointer, committed: list[int],
               resharded_files: Callable[[reshard.Sources], dict[str, Any]] | None) -> MemoryResume | None:
    """The snapshot of a job of another number of ranks to resume from (collective), or None; a
    WARNING when memory holds a newer step than the newest commit that this state cannot reshard from."""
    sources = resharding_sources(ck, committed, reshards=resharded_files is not None, framework="the Trainer's")
    if sources is None or resharded_files is None:
        return None
    try:
        files = resharded_files(sources)
        step = sources.choice.step
        path = write_byte_files(files, prefix=f"flashckpt-memory-{PREFIX_CHECKPOINT_DIR}-{step}-")
    except BaseException:
        sources.close()
        raise
    ck.start_attempt(step, from_memory=True, tag=sources.tag)
    logger.warning("flashckpt: resuming from the shared-memory snapshot of step %d, saved by %d ranks, onto %d ranks",
                   step, sources.choice.world_size, ck.world_size)
    return MemoryResume(step, path, files, sources)


def start_from_scratch(ck: Checkpointer, args: TrainingArguments) -> None:
    """``resume_from_checkpoint=None``: a new run in ``output_dir``; say what of an earlier run it leaves."""
    memory = newest_memory_step(ck)  # collective
    committed = ck.committed_steps()
    if args.should_save and (memory is not None or committed):
        held = ([f"a shared-memory snapshot of step {memory}"] if memory is not None else []) + (
            [f"committed checkpoints of steps {committed}"] if committed else [])
        logger.warning(
            "flashckpt: %s holds %s from an earlier run, and training starts from scratch "
            "(resume_from_checkpoint=None): they are not resumed, and saves of the same steps replace them. "
            "To resume instead, pass resume_from_checkpoint=True (--resume_from_checkpoint True).",
            args.output_dir, " and ".join(held))
    ck.start_attempt(None)


def resume_from_path(ck: Checkpointer, args: TrainingArguments, path: str) -> None:
    """An explicit checkpoint path: resumed by the stock code; say so when memory holds a newer snapshot."""
    step = checkpoint_step(path)
    memory = newest_memory_step(ck)  # collective
    if args.should_save and memory is not None and (step is None or memory > step):
        logger.warning(
            "flashckpt: resuming from %s as asked, although shared memory holds a complete snapshot of the "
            "newer step %d; it is not used. To resume from it, pass resume_from_checkpoint=True "
            "(--resume_from_checkpoint True).", path, memory)
    inside = os.path.normpath(os.path.dirname(os.path.normpath(path))) == os.path.normpath(args.output_dir)
    try:
        ck.start_attempt(step if inside and step is not None else None)
    except FlashCkptError:  # not one of ours (e.g. written by a plain Trainer): a run of its own
        ck.start_attempt(None)
