"""FlashCkptTrainer with Trainer subclasses: their own checkpoint files are in every snapshot and
committed with it, their own loading runs on a resume from memory and from storage, and a class
that lists another Trainer before FlashCkptTrainer is refused with the order to use."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

pytest.importorskip("transformers")

from transformers import Trainer  # noqa: E402

from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer  # noqa: E402
from tests.hf.common import FailAt, assert_bitwise_equal, make_trainer, parameters  # noqa: E402
from tests.hf.extra_state import ROLLOUT_STATE, CountSteps, StepCounter, steps_seen_name  # noqa: E402


class FlashStepCounter(FlashCkptTrainer, StepCounter):
    """Another library's Trainer subclass, composed as the README says."""


class OwnStepCounter(CountSteps, FlashCkptTrainer):
    """A user's own subclass of FlashCkptTrainer."""


def checkpoints(output_dir) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(output_dir) if n.startswith("checkpoint-"))


def _read(path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("cls", [FlashStepCounter, OwnStepCounter], ids=["library_subclass", "own_subclass"])
def test_a_subclass_state_survives_a_memory_resume_and_a_storage_resume(tmp_path, cls):
    out = tmp_path / "run"
    trainer = make_trainer(cls, str(out), max_steps=12, save_steps=4, flash_memory_interval=3)
    trainer.add_callback(FailAt(10))  # after the memory-only snapshot of step 9
    stock_writers = [mock.patch.object(Trainer, name, autospec=True, side_effect=AssertionError(name))
                     for name in ("save_model", "_save_optimizer_and_scheduler")]
    for writer in stock_writers:  # the snapshot holds the weights and the optimizer: never written twice
        writer.start()
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            trainer.train()
        trainer.remove_callback(FailAt)
        trainer.steps_seen = -100  # whatever the failed run left: the resume must load it
        trainer.train(resume_from_checkpoint=True)
    finally:
        for writer in stock_writers:
            writer.stop()
    assert trainer.flash_resumed_from == (9, "memory")
    assert trainer.rollout_resumed == {"step": 9}  # written before super()._save_checkpoint, memory-only step
    assert trainer.steps_seen == 12  # 9 from the snapshot (written after super()), then 3 more

    # Every committed folder holds the subclass's files of its step; memory-only steps made no folder.
    assert checkpoints(out) == [4, 8, 12]
    for step in (4, 8, 12):
        assert _read(out / f"checkpoint-{step}" / ROLLOUT_STATE) == {"step": step}
        assert _read(out / f"checkpoint-{step}" / steps_seen_name(0)) == {"steps_seen": step}
    assert not os.listdir(out / ".flashckpt" / "staging")

    stock = make_trainer(StepCounter, str(tmp_path / "stock"), max_steps=12, save_steps=4)
    stock.train()
    assert_bitwise_equal(parameters(trainer.model), parameters(stock.model))
    assert sorted(os.listdir(out / "checkpoint-8")) == sorted(os.listdir(tmp_path / "stock" / "checkpoint-8"))

    # From storage (memory was freed at the end): the committed folder's files, then 2 more steps.
    again = make_trainer(cls, str(out), max_steps=14, save_steps=4)
    again.train(resume_from_checkpoint=True)
    assert again.flash_resumed_from == (12, "storage")
    assert (again.steps_seen, again.rollout_resumed) == (14, {"step": 12})


def test_a_trainer_subclass_listed_before_flashckpttrainer_is_refused_with_the_order_to_use():
    with pytest.raises(TypeError, match=r"List FlashCkptTrainer first: class Wrong\(FlashCkptTrainer, StepCounter\)"):
        class Wrong(StepCounter, FlashCkptTrainer):
            pass


class SavesByItself(CountSteps, FlashCkptTrainer):
    """Skips FlashCkptTrainer's part: ``Trainer._save_checkpoint`` writes the whole checkpoint itself."""

    def _save_checkpoint(self, model, trial):
        Trainer._save_checkpoint(self, model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        with open(os.path.join(folder, steps_seen_name(0)), "w") as f:
            json.dump({"steps_seen": self.steps_seen}, f)
        with open(os.path.join(folder, ROLLOUT_STATE), "w") as f:
            json.dump({"step": self.state.global_step}, f)


def test_a_subclass_that_skips_super_keeps_what_it_writes_and_resumes_from_memory(tmp_path, caplog):
    trainer = make_trainer(SavesByItself, str(tmp_path / "run"), max_steps=8, save_steps=4, flash_memory_interval=3)
    trainer.add_callback(FailAt(7))
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.train()
    assert "SavesByItself._save_checkpoint does not call super()._save_checkpoint()" in caplog.text
    trainer.remove_callback(FailAt)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.flash_resumed_from == (6, "memory")
    assert (trainer.steps_seen, trainer.rollout_resumed) == (8, {"step": 6})
    assert checkpoints(tmp_path / "run") == [4, 8]
    stock = make_trainer(StepCounter, str(tmp_path / "stock"), max_steps=8, save_steps=4)
    stock.train()
    assert_bitwise_equal(parameters(trainer.model), parameters(stock.model))
    ours, theirs = tmp_path / "run" / "checkpoint-8", tmp_path / "stock" / "checkpoint-8"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
