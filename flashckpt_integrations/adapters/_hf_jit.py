"""``TrainingArguments(enable_jit_checkpoint=True)`` under :class:`FlashCkptTrainer`: a last checkpoint
on SIGTERM, committed before the save returns, with no folder before the commit.

Stock JIT checkpointing waits 3 s after SIGTERM (to tell a SIGTERM from the SIGKILL that follows
it), then creates ``checkpoint-N/`` with an "incomplete" sentinel and writes into it. With flash
saves that returns once the state is copied, so the sentinel would go before the files are
durable; and a folder created before the writes outlives a grace period that ends first, so the
same command then fails on it (``Can't find a valid checkpoint``). Here:

- the save is taken at the first step boundary after SIGTERM (not 3 s later: a flash save is one
  memory copy, so every second of the grace is left for writing it; not between the backward pass
  and the optimizer step, where the RNG has moved on from the saved weights);
- it is a persisting save whose folder appears only when it is committed (staging, then one
  rename), and the request returns once it is committed or has failed;
- the node's saver, stopped by the same signal, serves this save while the grace leaves room (see
  :mod:`flashckpt_integrations.core.preemption`); the newest snapshot in memory is what it
  persists otherwise.

Call order: ``signal.getsignal(SIGTERM)`` before ``Trainer.__init__`` (which registers the stock
callback and its handler), then :func:`take_over` once, from ``FlashCkptTrainer.__init__``; the
stock ``JITCheckpointCallback`` then calls :meth:`FlashJIT.execute_jit_checkpoint` at its hooks
and restores the signal handler at the end.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class FlashJIT(TrainerCallback):
    """Stands in for the stock callback's ``jit_manager`` (the attributes that callback uses); as a
    callback of its own it tells a step boundary from the middle of a step."""

    def __init__(self, save: Callable[[], None], original_handler: Any) -> None:
        self._save = save
        self._original_sigterm_handler = original_handler
        self.signalled = False
        """SIGTERM came (the save may still wait for a step boundary)."""
        self._requested = False
        self._mid_step = False

    @property
    def is_checkpoint_requested(self) -> bool:
        return self._requested and not self._mid_step

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        if not self.signalled:
            self.signalled = self._requested = True

    def execute_jit_checkpoint(self) -> None:
        self._requested = False
        logger.warning("flashckpt: SIGTERM: saving a last checkpoint before stopping")
        self._save()

    # The stock callback comes first (a default one): at a step's begin it sees the boundary before
    # this marks the step begun; at its end, after the optimizer step, the step is over.
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._mid_step = True

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._mid_step = False


def take_over(trainer: Any, save: Callable[[], None], original_handler: Any) -> FlashJIT | None:
    """Give the stock JIT callback of ``trainer`` (if any) a :class:`FlashJIT` that calls ``save``;
    ``original_handler`` is the SIGTERM handler from before the stock one, restored at the end."""
    try:
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback
    except ImportError:  # a transformers release without JIT checkpointing
        return None
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, JITCheckpointCallback) and getattr(callback, "jit_manager", None) is not None:
            manager = FlashJIT(save, original_handler)
            manager.install()
            callback.jit_manager = manager
            trainer.add_callback(manager)
            return manager
    return None
