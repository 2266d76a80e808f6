"""FlashCkptTrainer composed with TRL's real trainers: ``class T(FlashCkptTrainer, SFTTrainer)``.

A crash after a memory-only snapshot resumes from memory and ends with the weights of the stock
trainer's uninterrupted run; every committed folder holds the files the stock trainer writes, and
the trainer's own files (TRL's model card, GRPOTrainer's entropy controller, state a subclass adds)
are written at every save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from tests.distributed.launch import free_port, torchrun_cmd  # noqa: E402
from tests.hf.common import FailAt, assert_bitwise_equal, parameters  # noqa: E402
from tests.hf.extra_state import ROLLOUT_STATE, steps_seen_name  # noqa: E402
from tests.hf.trl_script import make_trainer, trainer_class  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "trl_script.py")
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "rng_state.pth")


def checkpoints(output_dir) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(output_dir) if n.startswith("checkpoint-"))


def _env() -> dict[str, str]:
    # OMP_NUM_THREADS=1: every run computes in the same order, so results compare bit for bit.
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _script(run_dir, *extra: str, ranks: int = 1) -> list[str]:
    # Each run's output_dir is named "out": TRL's model card names the model after it.
    launcher = torchrun_cmd(ranks, free_port()) if ranks > 1 else [sys.executable]
    return [*launcher, SCRIPT, "--out", str(run_dir / "out"), "--result", str(run_dir / "final.pt"), *extra]


def _summary(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith('{"')][-1])


def _model_card(output_dir) -> list[str]:
    """The lines of TRL's model card, ``<output_dir>/README.md`` (its tags come from a set, in any order)."""
    return sorted((output_dir / "README.md").read_text().splitlines())


def _trainer_state(folder) -> dict:
    """``trainer_state.json`` without SFTTrainer's ``num_tokens`` (a count it keeps in memory only, which
    restarts at 0 after any resume, stock or flash)."""
    with open(folder / "trainer_state.json") as f:
        state = json.load(f)
    state["log_history"] = [{k: v for k, v in entry.items() if k != "num_tokens"} for entry in state["log_history"]]
    return state


def _wait_for_checkpoints(out, expected: list[int]) -> None:
    deadline = time.monotonic() + 30  # the saver finishes what was in flight at the crash
    while checkpoints(out) != expected and time.monotonic() < deadline:
        time.sleep(0.05)


def _crash_and_resume(tmp_path, *extra: str, kill_at: int, committed: list[int], ranks: int = 1):
    """The stock run, and a flash run killed after the memory snapshot of ``kill_at`` then resumed."""
    reference = subprocess.Popen(_script(tmp_path / "stock", "--plain", *extra, ranks=ranks), env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    crashed = subprocess.run(_script(tmp_path / "flash", "--kill-at", str(kill_at), *extra, ranks=ranks),
                             env=_env(), capture_output=True, text=True, timeout=240)
    logs = crashed.stdout + crashed.stderr
    assert crashed.returncode != 0 and f'{{"killing_at": {kill_at}}}' in crashed.stdout, logs
    if ranks == 1:
        assert crashed.returncode == -signal.SIGKILL, logs
    _wait_for_checkpoints(tmp_path / "flash" / "out", committed)
    assert checkpoints(tmp_path / "flash" / "out") == committed, logs
    resumed = subprocess.run(_script(tmp_path / "flash", "--resume", *extra, ranks=ranks), env=_env(),
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    out, _ = reference.communicate(timeout=240)
    assert reference.returncode == 0, out
    return _summary(resumed.stdout), resumed.stdout + resumed.stderr


def test_sft_killed_after_a_memory_snapshot_resumes_from_memory_as_the_stock_run_ends(tmp_path, private_shm_dir):
    # 10 steps: checkpoints 4, 8, 10; memory-only snapshots 3, 6, 9; killed after the snapshot of 6.
    summary, logs = _crash_and_resume(tmp_path, "--trainer", "sft", kill_at=6, committed=[4])
    assert summary["resumed_from"] == [6, "memory"] and summary["final_step"] == 10, logs
    assert "could not persist" not in logs and "ERROR" not in logs, logs[-3000:]
    assert_bitwise_equal(torch.load(tmp_path / "flash" / "final.pt"), torch.load(tmp_path / "stock" / "final.pt"))
    ours, theirs = tmp_path / "flash" / "out", tmp_path / "stock" / "out"
    assert checkpoints(ours) == checkpoints(theirs) == [4, 8, 10]
    assert _model_card(ours) == _model_card(theirs)
    for step in (4, 8, 10):  # the files of the stock trainer, the same small files before and after the crash
        assert sorted(os.listdir(ours / f"checkpoint-{step}")) == sorted(os.listdir(theirs / f"checkpoint-{step}"))
        for name in SMALL_FILES:
            assert (ours / f"checkpoint-{step}" / name).read_bytes() == \
                (theirs / f"checkpoint-{step}" / name).read_bytes(), (step, name)
        assert _trainer_state(ours / f"checkpoint-{step}") == _trainer_state(theirs / f"checkpoint-{step}")
    assert os.listdir(private_shm_dir) == []  # a clean end frees the shared memory


@pytest.mark.distributed
def test_sft_two_ranks_with_state_of_its_own_resumes_it_from_memory_on_every_rank(tmp_path, private_shm_dir):
    # 2 gloo ranks, 8 steps per epoch: checkpoints 4, 8; memory-only snapshots 3, 6; rank 0 killed after 6.
    extra = ("--trainer", "sft", "--count-steps", "--max-steps", "8")
    summary, logs = _crash_and_resume(tmp_path, *extra, kill_at=6, committed=[4], ranks=2)
    assert summary["resumed_from"] == [6, "memory"], logs
    assert summary["steps_seen"] == [8, 8], logs  # each rank's own count came back from its own slot
    assert_bitwise_equal(torch.load(tmp_path / "flash" / "final.pt"), torch.load(tmp_path / "stock" / "final.pt"))
    ours, theirs = tmp_path / "flash" / "out", tmp_path / "stock" / "out"
    for step in (4, 8):
        names = sorted(os.listdir(ours / f"checkpoint-{step}"))
        assert names == sorted(os.listdir(theirs / f"checkpoint-{step}"))
        own = {ROLLOUT_STATE, steps_seen_name(0), steps_seen_name(1)}
        assert own | {"rng_state_0.pth", "rng_state_1.pth"} <= set(names)
        for rank in (0, 1):
            with open(ours / f"checkpoint-{step}" / steps_seen_name(rank)) as f:
                assert json.load(f) == {"steps_seen": step}
    assert (ours / "README.md").exists()


def test_dpo_resumes_from_a_memory_snapshot_after_a_failure_as_the_stock_run_ends(tmp_path):
    flash = make_trainer("dpo", trainer_class("dpo", plain=False, count_steps=True), str(tmp_path / "flash" / "out"),
                         max_steps=8, save_steps=4, flash_memory_interval=3)
    flash.add_callback(FailAt(7))  # after the memory-only snapshot of step 6
    with pytest.raises(RuntimeError, match="injected failure"):
        flash.train()
    flash.remove_callback(FailAt)
    flash.train(resume_from_checkpoint=True)
    assert flash.flash_resumed_from == (6, "memory")
    assert (flash.steps_seen, flash.rollout_resumed) == (8, {"step": 6})

    stock = make_trainer("dpo", trainer_class("dpo", plain=True, count_steps=False), str(tmp_path / "stock" / "out"),
                         max_steps=8, save_steps=4)
    stock.train()
    assert_bitwise_equal(parameters(flash.model), parameters(stock.model))
    ours, theirs = tmp_path / "flash" / "out", tmp_path / "stock" / "out"
    assert checkpoints(ours) == checkpoints(theirs) == [4, 8]
    assert _model_card(ours) == _model_card(theirs)
    for step in (4, 8):  # the stock trainer's files, and the subclass's own
        assert sorted(os.listdir(ours / f"checkpoint-{step}")) == \
            sorted([*os.listdir(theirs / f"checkpoint-{step}"), ROLLOUT_STATE, steps_seen_name(0)])


def test_grpo_adaptive_entropy_state_survives_a_memory_resume(tmp_path):
    # GRPOTrainer keeps its entropy controller in checkpoint-N/entropy_ctrl_state.json (written after
    # super()._save_checkpoint, read in _load_optimizer_and_scheduler).
    flash = make_trainer("grpo", trainer_class("grpo", plain=False, count_steps=False), str(tmp_path / "flash" / "out"),
                         max_steps=6, save_steps=3, flash_memory_interval=2)
    coefficients: dict[str, float] = {}

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # the resumed state is loaded by then
            coefficients["begin"] = flash.entropy_coef

        def on_step_end(self, args, state, control, **kwargs):
            coefficients[state.global_step] = flash.entropy_coef

    flash.add_callback(Record())
    flash.add_callback(FailAt(5))  # after the memory-only snapshot of step 4
    with pytest.raises(RuntimeError, match="injected failure"):
        flash.train()
    flash.remove_callback(FailAt)
    flash.entropy_coef = -1.0  # whatever the failed run left: the resume must load it
    flash.train(resume_from_checkpoint=True)
    assert flash.flash_resumed_from == (4, "memory")
    assert coefficients["begin"] == coefficients[4] > 0

    stock = make_trainer("grpo", trainer_class("grpo", plain=True, count_steps=False), str(tmp_path / "stock" / "out"),
                         max_steps=6, save_steps=3)
    stock.train()
    assert_bitwise_equal(parameters(flash.model), parameters(stock.model))
    assert flash.entropy_coef == stock.entropy_coef
    ours, theirs = tmp_path / "flash" / "out", tmp_path / "stock" / "out"
    for step in (3, 6):
        assert sorted(os.listdir(ours / f"checkpoint-{step}")) == sorted(os.listdir(theirs / f"checkpoint-{step}"))
        assert (ours / f"checkpoint-{step}" / "entropy_ctrl_state.json").read_bytes() == \
            (theirs / f"checkpoint-{step}" / "entropy_ctrl_state.json").read_bytes()
