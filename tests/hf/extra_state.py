"""Trainers that keep state of their own in their checkpoints, as TRL's do.

``GRPOTrainer`` writes ``entropy_ctrl_state.json`` after ``super()._save_checkpoint()`` and reads it
back in ``_load_optimizer_and_scheduler``; TRL's async trainers write ``rollout_state.json`` before
``super()``, into a folder they make themselves. :class:`CountSteps` does both: every rank counts the
training steps it ran (``steps_seen_<rank>.json``, after ``super()``) and the main process records
where the run stands (``rollout_state.json``, before ``super()``). A run that resumes without them
counts from 0 again.
"""

from __future__ import annotations

import json
import os

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

ROLLOUT_STATE = "rollout_state.json"


def steps_seen_name(rank: int) -> str:
    return f"steps_seen_{rank}.json"


class CountSteps:
    """A mixin for a ``Trainer`` (class): the state, its saving and its loading."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps_seen = 0
        self.rollout_resumed: dict | None = None  # rollout_state.json of the checkpoint resumed from

    def training_step(self, *args, **kwargs):
        self.steps_seen += 1
        return super().training_step(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, ROLLOUT_STATE), "w") as f:
                json.dump({"step": self.state.global_step}, f)
        super()._save_checkpoint(model, trial)
        with open(os.path.join(folder, steps_seen_name(self.args.process_index)), "w") as f:
            json.dump({"steps_seen": self.steps_seen}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        with open(os.path.join(checkpoint, steps_seen_name(self.args.process_index))) as f:
            self.steps_seen = json.load(f)["steps_seen"]
        with open(os.path.join(checkpoint, ROLLOUT_STATE)) as f:
            self.rollout_resumed = json.load(f)


class StepCounter(CountSteps, Trainer):
    """A ``Trainer`` subclass of another library, as TRL's are."""
