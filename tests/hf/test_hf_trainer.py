"""FlashCkptTrainer: native HF checkpoints written by the saver, resume from memory after a crash, retention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback  # noqa: E402

from flashckpt_integrations import CheckpointerConfig, Layout  # noqa: E402
from flashckpt_integrations.adapters import _hf_files  # noqa: E402
from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer  # noqa: E402
from tests.distributed.launch import free_port, torchrun_cmd  # noqa: E402
from tests.helpers import complete_slots, flip_slot_byte, marker_names, run_python  # noqa: E402
from tests.hf.common import FailAt, assert_bitwise_equal, make_trainer, parameters  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "train_script.py")


def checkpoints(output_dir) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(output_dir) if n.startswith("checkpoint-"))


def test_saver_writes_native_checkpoints_that_plain_trainer_resumes(tmp_path):
    flash = make_trainer(FlashCkptTrainer, str(tmp_path / "flash"), max_steps=12, save_steps=4, flash_memory_interval=2)
    flash.train()
    assert flash.flash_last_save.status.value == "persisting" and flash.flash_last_save.step == 12
    assert checkpoints(tmp_path / "flash") == [4, 8, 12]
    assert not os.listdir(tmp_path / "flash" / ".flashckpt" / "staging")

    stock = make_trainer(Trainer, str(tmp_path / "stock"), max_steps=12, save_steps=4)
    stock.train()
    assert_bitwise_equal(parameters(flash.model), parameters(stock.model))

    # The same files as the stock Trainer, with the same content.
    ours, theirs = tmp_path / "flash" / "checkpoint-8", tmp_path / "stock" / "checkpoint-8"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs)) == sorted([
        "config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "rng_state.pth",
        "scheduler.pt", "trainer_state.json", "training_args.bin"])
    for name in ("config.json", "generation_config.json", "trainer_state.json", "rng_state.pth"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    weights = load_file(ours / "model.safetensors")
    assert_bitwise_equal(weights, load_file(theirs / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied to transformer.wte.weight, dropped as save_pretrained does
    with safe_open(ours / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    optimizer = torch.load(ours / "optimizer.pt", weights_only=True)
    expected = torch.load(theirs / "optimizer.pt", weights_only=True)
    assert optimizer["param_groups"] == expected["param_groups"]
    for index, state in expected["state"].items():
        assert_bitwise_equal(optimizer["state"][index], state)
    assert torch.load(ours / "scheduler.pt", weights_only=True) == torch.load(theirs / "scheduler.pt",
                                                                              weights_only=True)
    assert torch.load(ours / "training_args.bin", weights_only=False).max_steps == 12

    # A plain Trainer resumes from the saver's checkpoint and ends bit for bit where the uninterrupted run did.
    resumed = make_trainer(Trainer, str(tmp_path / "resumed"), max_steps=12, save_steps=4)
    resumed.train(resume_from_checkpoint=str(ours))
    assert_bitwise_equal(parameters(resumed.model), parameters(stock.model))

    assert_bitwise_equal(parameters(GPT2LMHeadModel.from_pretrained(tmp_path / "flash" / "checkpoint-12")),
                         parameters(stock.model))  # lm_head tied back to the embedding

    # Nothing left in memory after a clean end: resume=True finds the newest commit on storage.
    again = make_trainer(FlashCkptTrainer, str(tmp_path / "flash"), max_steps=12, save_steps=4)
    again.train(resume_from_checkpoint=True)
    assert again.flash_resumed_from == (12, "storage")


def _env() -> dict[str, str]:
    # OMP_NUM_THREADS=1: every run computes in the same order, so results compare bit for bit.
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def _script(out, result, *extra: str, ranks: int = 1) -> list[str]:
    launcher = torchrun_cmd(ranks, free_port()) if ranks > 1 else [sys.executable]
    return [*launcher, SCRIPT, "--out", str(out), "--result", str(result), *extra]


def _summary(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("flip", [False, True], ids=["intact", "flipped-byte"])
def test_kill_after_memory_snapshot_resumes_from_memory_bit_exact(tmp_path, private_shm_dir, flip):
    # 20 steps (16 per epoch): checkpoints every 5 steps, memory snapshots every 3; killed after step 18.
    # flipped-byte: a stray write hits the snapshot of step 18; the resume takes the other verified
    # snapshot (step 15, as new as the newest commit) and still ends bit-exact.
    reference = subprocess.Popen(_script(tmp_path / "ref", tmp_path / "ref.pt", "--plain"), env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    crashed = subprocess.run(_script(tmp_path / "run", tmp_path / "run.pt", "--kill-at", "18"), env=_env(),
                             capture_output=True, text=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    assert _summary(crashed.stdout) == {"killing_at": 18}
    # Storage holds checkpoints up to 15 (the saver finishes what was in flight); step 18 is in memory only.
    deadline = time.monotonic() + 30
    while checkpoints(tmp_path / "run") != [5, 10, 15] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checkpoints(tmp_path / "run") == [5, 10, 15], crashed.stdout + crashed.stderr
    if flip:
        slots = {step: path for _, step, path in complete_slots(private_shm_dir)}
        assert sorted(slots) == [15, 18], slots
        flip_slot_byte(slots[18])

    resumed = subprocess.run(_script(tmp_path / "run", tmp_path / "run.pt", "--resume"), env=_env(),
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    logs = resumed.stdout + resumed.stderr
    step = 15 if flip else 18
    assert _summary(resumed.stdout) == {"final_step": 20, "resumed_from": [step, "memory"]}, logs
    assert f"resuming from the shared-memory snapshot of step {step}" in resumed.stderr, logs
    assert ("the snapshot of step 18 in memory failed verification" in resumed.stderr) == flip, logs
    assert checkpoints(tmp_path / "run") == [5, 10, 15, 20], logs  # no checkpoint-18 was ever written

    out, _ = reference.communicate(timeout=120)
    assert reference.returncode == 0, out
    assert_bitwise_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "ref.pt"))
    assert os.listdir(private_shm_dir) == []  # a clean end frees the shared memory


@pytest.mark.distributed
def test_ddp_two_ranks_kill_rank0_resumes_from_memory_bit_exact(tmp_path, private_shm_dir):
    # 2 gloo ranks, 8 steps per epoch: checkpoints every 4 steps, memory every 3; rank 0 killed after step 9.
    steps = ("--max-steps", "12", "--save-steps", "4", "--memory-interval", "3")
    reference = subprocess.Popen(_script(tmp_path / "ref", tmp_path / "ref.pt", "--plain", *steps, ranks=2),
                                 env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    crashed = subprocess.run(_script(tmp_path / "run", tmp_path / "run.pt", "--kill-at", "9", *steps, ranks=2),
                             env=_env(), capture_output=True, text=True, timeout=120)
    assert crashed.returncode != 0 and '{"killing_at": 9}' in crashed.stdout, crashed.stdout + crashed.stderr
    deadline = time.monotonic() + 30  # the saver finishes the commit of step 8 if it was in flight
    while checkpoints(tmp_path / "run") != [4, 8] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checkpoints(tmp_path / "run") == [4, 8], crashed.stdout + crashed.stderr
    assert len(os.listdir(private_shm_dir)) == 4  # two slots per rank survive the crash

    resumed = subprocess.run(_script(tmp_path / "run", tmp_path / "run.pt", "--resume", *steps, ranks=2),
                             env=_env(), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    logs = resumed.stdout + resumed.stderr
    assert _summary(resumed.stdout) == {"final_step": 12, "resumed_from": [9, "memory"]}, logs
    assert resumed.stderr.count("resuming from the shared-memory snapshot of step 9") == 2, logs  # both ranks
    assert checkpoints(tmp_path / "run") == [4, 8, 12], logs
    names = set(os.listdir(tmp_path / "run" / "checkpoint-12"))
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= names

    out, _ = reference.communicate(timeout=120)
    assert reference.returncode == 0, out
    assert names == set(os.listdir(tmp_path / "ref" / "checkpoint-12"))
    assert_bitwise_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "ref.pt"))
    assert os.listdir(private_shm_dir) == []


def test_exception_keeps_memory_and_the_same_trainer_resumes_from_it(tmp_path):
    trainer = make_trainer(FlashCkptTrainer, str(tmp_path / "run"), max_steps=12, save_steps=4,
                           flash_memory_interval=3)
    trainer.add_callback(FailAt(10))  # after the memory snapshot of step 9, with step 10 applied
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.train()
    trainer.remove_callback(FailAt)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.flash_resumed_from == (9, "memory")
    assert checkpoints(tmp_path / "run") == [4, 8, 12]

    stock = make_trainer(Trainer, str(tmp_path / "stock"), max_steps=12, save_steps=4)
    stock.train()
    assert_bitwise_equal(parameters(trainer.model), parameters(stock.model))


def test_save_total_limit_keeps_the_two_newest_committed_checkpoints(tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(FlashCkptTrainer, str(out), max_steps=10, save_steps=2, args={"save_total_limit": 2})
    trainer.train()
    deadline = time.monotonic() + 30  # retention runs right after the commit that train() waited for

    def markers():
        return sorted(os.listdir(out / ".flashckpt" / "steps"))

    while (checkpoints(out) != [8, 10] or markers() != ["10", "8"]) and time.monotonic() < deadline:
        time.sleep(0.05)  # (a step's folder goes first, then its markers)
    assert checkpoints(out) == [8, 10]
    assert markers() == ["10", "8"]
    for step in (8, 10):
        assert torch.load(out / f"checkpoint-{step}" / "optimizer.pt", weights_only=True)["state"]


def test_models_over_the_shard_size_are_split_like_save_pretrained(tmp_path, monkeypatch):
    monkeypatch.setattr(_hf_files, "MAX_SHARD_SIZE", "200KB")
    trainer = make_trainer(FlashCkptTrainer, str(tmp_path / "run"), max_steps=8, save_steps=4, flash_memory_interval=3)
    trainer.add_callback(FailAt(7))
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.train()
    trainer.remove_callback(FailAt)
    trainer.train(resume_from_checkpoint=True)  # weights restored from the sharded memory snapshot
    assert trainer.flash_resumed_from == (6, "memory")
    names = sorted(os.listdir(tmp_path / "run" / "checkpoint-4"))
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) == 3 and "model.safetensors.index.json" in names and "model.safetensors" not in names
    index = json.loads((tmp_path / "run" / "checkpoint-4" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards

    stock = make_trainer(Trainer, str(tmp_path / "stock"), max_steps=8, save_steps=4)
    stock.train()
    assert_bitwise_equal(parameters(trainer.model), parameters(stock.model))
    resumed = make_trainer(Trainer, str(tmp_path / "resumed"), max_steps=8, save_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert_bitwise_equal(parameters(resumed.model), parameters(stock.model))


CRASH_DURING_PERSIST = """
import glob, os, subprocess, sys, time
from transformers import TrainerCallback
from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer
from tests.helpers import saver_pids
from tests.hf.common import make_trainer

class CrashDuringPersist(TrainerCallback):
    # At step 12's save: kill the node's saver while it writes checkpoint-12, and this process, at
    # once (one kill(1) call): a trainer that outlives its saver starts a new one, which would finish
    # the save.
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 12:
            staging = os.path.join(args.output_dir, ".flashckpt", "staging", "*", "checkpoint-12")
            deadline = time.monotonic() + 30
            while not glob.glob(staging) and time.monotonic() < deadline:
                time.sleep(0.01)
            pids = saver_pids(trainer.flash_checkpointer.run_dir)
            subprocess.run(["kill", "-9", *map(str, pids), str(os.getpid())])

trainer = make_trainer(FlashCkptTrainer, sys.argv[1], max_steps=16, save_steps=4, args={"save_total_limit": 2},
                       flash_config={"storage_factory": "tests.helpers:SlowStorage"})
trainer.add_callback(CrashDuringPersist())
trainer.train()
"""


def test_a_crash_during_a_save_never_costs_the_newest_committed_checkpoint(tmp_path):
    out = tmp_path / "run"
    # each data file of a checkpoint waits 0.2 s before it is written: the kill lands mid-persist
    crashed = run_python(CRASH_DURING_PERSIST, str(out), env={"FLASHCKPT_TEST_WRITE_DELAY": "0.2"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    # The newest committed checkpoint (8) and the one before it survive; 12 never appears half written.
    assert checkpoints(out) == [4, 8]
    assert marker_names(out / ".flashckpt" / "steps" / "8") == ["COMMITTED", "rank-0.done"]
    stock = make_trainer(Trainer, str(out / "stock"), max_steps=16, save_steps=4)
    stock.train(resume_from_checkpoint=str(out / "checkpoint-8"))  # the plain Trainer resumes from it
    assert stock.state.global_step == 16

    restarted = make_trainer(FlashCkptTrainer, str(out), max_steps=16, save_steps=4, args={"save_total_limit": 2})
    restarted.train(resume_from_checkpoint=True)
    assert restarted.flash_resumed_from == (12, "memory")  # the snapshot of the interrupted save
    # The restarted job's saver finishes the interrupted save of 12 from its slot; retention keeps two.
    deadline = time.monotonic() + 30
    while checkpoints(out) != [12, 16] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checkpoints(out) == [12, 16]
    assert torch.load(out / "checkpoint-12" / "optimizer.pt", weights_only=True)["state"]
    assert_bitwise_equal(parameters(restarted.model), parameters(stock.model))


@pytest.mark.parametrize(
    ("kwargs", "args", "error", "match"),
    [
        ({"flash_memory_interval": 5}, {"save_only_model": True}, ValueError, "Set save_only_model=False"),
        ({"flash_config": {"layout": {"step_dir": "x-{step}"}}}, {}, ValueError, "Remove 'layout'"),
        ({"flash_config": CheckpointerConfig(layout=Layout(step_dir="x-{step}"))}, {}, ValueError, "Remove 'layout'"),
        ({"flash_config": {"retention": {"keep_last": 3}}}, {"save_total_limit": 2}, ValueError, "only one"),
        ({"flash_config": "fast"}, {}, TypeError, "CheckpointerConfig or a dict"),
        ({"flash_memory_interval": 0}, {}, ValueError, "positive number of steps"),
        ({"flash_config": {"on_slot_busy": "drop"}}, {}, ValueError, "on_slot_busy"),
    ],
)
def test_options_that_cannot_work_together_fail_at_construction(tmp_path, kwargs, args, error, match):
    with pytest.raises(error, match=match):
        make_trainer(FlashCkptTrainer, str(tmp_path / "run"), max_steps=4, save_steps=2, args=args, **kwargs)


def test_save_on_each_node_falls_back_only_when_the_job_spans_nodes(monkeypatch):
    from flashckpt_integrations.adapters.hf_trainer import _spans_nodes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not _spans_nodes(2) and _spans_nodes(4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not _spans_nodes(1) and not _spans_nodes(2)  # no launcher variables: one node


def test_slots_are_prepared_after_the_first_step_so_the_first_save_creates_nothing(tmp_path):
    sizes: dict[int, list[int | None]] = {}

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ck = trainer.flash_checkpointer
            ck.slots.helper.submit(lambda: None).result()  # the background preparation is done
            slots = map(ck.slots.mapped, range(ck.slots.count))
            sizes[state.global_step] = [s.size if s is not None else None for s in slots]

    trainer = make_trainer(FlashCkptTrainer, str(tmp_path / "out"), max_steps=4, save_steps=3, callbacks=[Watch()])
    trainer.train()
    assert trainer.flash_last_save.step == 4
    # step 1's callback runs before the first _maybe_log_save_evaluate: nothing yet
    assert sizes[1] == [None, None]
    prepared = sizes[2]
    assert None not in prepared
    assert sizes[3] == prepared == sizes[4], "the saves at steps 3 and 4 had to create or grow a slot"
    assert checkpoints(tmp_path / "out") == [3, 4]
