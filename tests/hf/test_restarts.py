"""Restarts as users do them, with a script shaped like HF's run_clm.py (tests/hf/example_script.py):
the same command again, ``--resume_from_checkpoint True`` from the command line, an explicit older
checkpoint, and ``rm -rf`` of the output directory before the relaunch."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.helpers import REPO, saver_pids, savers_with_shm_dir  # noqa: E402
from tests.hf.common import assert_bitwise_equal  # noqa: E402

SCRIPT = os.path.join(REPO, "tests", "hf", "example_script.py")
STEPS, SAVE_EVERY, MEMORY_EVERY = 20, 5, 3  # commits 5, 10, 15, 20; memory-only snapshots 3, 6, 9, 12, 18


def command(out, *args, kill_at=None, result=None, stock=False) -> list[str]:
    cmd = [sys.executable, SCRIPT, "--output_dir", str(out), "--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY),
           "--per_device_train_batch_size", "4",
           "--learning_rate", "1e-3", "--logging_steps", "1", "--seed", "42", "--report_to", "none", "--use_cpu",
           "True", "--disable_tqdm", "True", "--dataloader_num_workers", "0", *args]
    cmd += ["--stock", "True"] if stock else ["--flash_memory_interval", str(MEMORY_EVERY)]
    if kill_at is not None:
        cmd += ["--kill_at", str(kill_at)]
    if result is not None:
        cmd += ["--result", str(result)]
    return cmd


SCRIPT_ENV = {"PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}


def run(out, *args, kill_at=None, result=None, stock=False):
    proc = subprocess.run(command(out, *args, kill_at=kill_at, result=result, stock=stock), capture_output=True,
                          text=True, timeout=240, cwd=REPO, env={**os.environ, **SCRIPT_ENV})
    if kill_at is None:
        assert proc.returncode == 0, proc.stderr[-4000:]
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{\"")]
    begin = next(line for line in lines if "resumed_from" in line)
    return begin, proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run: its final weights and each checkpoint's weights."""
    base = tmp_path_factory.mktemp("reference")
    run(base / "out", result=base / "final.pt")
    weights = {s: load_file(base / "out" / f"checkpoint-{s}" / "model.safetensors") for s in (5, 10, 15, 20)}
    return torch.load(base / "final.pt"), weights


def test_the_same_command_again_trains_from_scratch_and_every_save_supersedes(tmp_path, reference):
    final, weights = reference
    out = tmp_path / "out"
    run(out, kill_at=12)  # commits 5 and 10, memory snapshot of 12
    begin, log = run(out, result=tmp_path / "final.pt")  # no resume flag: the stock Trainer starts over too
    assert begin == {"resumed_from": None, "start_step": 0}
    assert "holds a shared-memory snapshot of step 12 and committed checkpoints of steps [5, 10]" in log
    assert "--resume_from_checkpoint True" in log
    assert "could not persist" not in log and "ERROR" not in log, log[-3000:]
    assert_bitwise_equal(torch.load(tmp_path / "final.pt"), final)
    for step, expected in weights.items():  # the folders hold the new run's weights (those of an uninterrupted run)
        assert_bitwise_equal(load_file(out / f"checkpoint-{step}" / "model.safetensors"), expected)
    # The log says where each checkpoint lands and how long training was held, once per save.
    held = [line for line in log.splitlines() if "flashckpt: Trainer save of step" in line]
    assert len([line for line in held if "persisting to" in line]) == 4, held
    assert f"persisting to {out}/checkpoint-10 (training held" in log
    assert "/tmp/flashckpt-files" not in log
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):  # valid zips, as torch.save writes them
        with zipfile.ZipFile(out / "checkpoint-20" / name) as archive:
            assert archive.testzip() is None, name


def test_resume_flags_from_the_command_line_and_a_deleted_output_directory(tmp_path, reference):
    final, _ = reference
    out = tmp_path / "out"
    run(out, kill_at=12)
    # The string "True" (as every HF example script passes it) resumes, from memory.
    begin, _ = run(out, "--resume_from_checkpoint", "True", kill_at=18)
    assert begin == {"resumed_from": [12, "memory"], "start_step": 12}
    # An explicit older checkpoint is honoured, with a warning about the newer snapshot in memory.
    begin, log = run(out, "--resume_from_checkpoint", str(out / "checkpoint-15"), kill_at=18)
    assert begin == {"resumed_from": None, "start_step": 15}
    assert "shared memory holds a complete snapshot of the newer step 18" in log
    # rm -rf of the output directory, then the same resuming command: a fresh start, not the stale memory.
    shutil.rmtree(out)
    begin, log = run(out, "--resume_from_checkpoint", "True", result=tmp_path / "final.pt")
    assert begin == {"resumed_from": None, "start_step": 0}, log[-3000:]
    assert_bitwise_equal(torch.load(tmp_path / "final.pt"), final)


# --- preemption: SIGTERM to every process of the job, SIGKILL when the grace period is over ----------------


def stop_at(out, step: int, grace_s: float, *args, memory_lost: bool = True) -> dict:
    """Run the script until the snapshot of ``step``, then preempt it: SIGTERM to the script and its
    saver, SIGKILL to whatever is left when the grace period ends, the node's memory wiped (a new node).
    Returns the JSON lines the script printed, by key."""
    proc = subprocess.Popen(command(out, "--pause_at", str(step), *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
                            env={**os.environ, **SCRIPT_ENV, "FLASHCKPT_GRACE_S": str(grace_s)})
    lines: dict = {}
    for line in proc.stdout:
        if line.startswith("{\""):
            lines.update(json.loads(line))
        if "paused_at" in lines:
            break
    assert lines.get("paused_at") == step, (lines, proc.stderr.read()[-4000:] if proc.poll() is not None else "")
    savers = saver_pids(lines["run_dir"])
    assert len(savers) == 1, savers
    for pid in (proc.pid, *savers):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or saver_pids(lines["run_dir"])):
        time.sleep(0.05)
    for pid in (proc.pid, *saver_pids(lines["run_dir"])):  # the grace is over
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=30)
    for line in stdout.splitlines():
        if line.startswith("{\""):
            lines.update(json.loads(line))
    lines["stderr"] = stderr
    if memory_lost:
        shm = os.environ["FLASHCKPT_SHM_DIR"]
        for name in os.listdir(shm):
            os.unlink(os.path.join(shm, name))
    return lines


def savers_of_this_test() -> list[int]:
    """The savers started with this test's shared-memory directory."""
    return savers_with_shm_dir(os.environ["FLASHCKPT_SHM_DIR"])


def test_sigterm_persists_the_newest_snapshot_as_a_checkpoint_the_stock_trainer_resumes(tmp_path, reference):
    final, _ = reference
    out = tmp_path / "out"
    stopped = stop_at(out, 12, grace_s=20)  # commits 5 and 10; the saver persists 12 from memory
    assert (out / "checkpoint-12" / "trainer_state.json").exists(), (os.listdir(out), stopped["stderr"][-3000:])
    # every file Trainer writes is there: config, generation config, training args with the weights
    for name in ("config.json", "generation_config.json", "training_args.bin", "model.safetensors"):
        assert (out / "checkpoint-12" / name).exists(), name
    # a process that never imports us: from_pretrained, then the stock Trainer resumes from the folder
    check = ("import sys; from transformers import AutoModelForCausalLM; "
             f"AutoModelForCausalLM.from_pretrained({str(out / 'checkpoint-12')!r}); "
             "assert not any(m.startswith('flashckpt_integrations') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", check], check=True, cwd=REPO, env={**os.environ, **SCRIPT_ENV})
    begin, _ = run(out, "--resume_from_checkpoint", str(out / "checkpoint-12"), stock=True, result=tmp_path / "f.pt")
    assert begin == {"resumed_from": None, "start_step": 12}
    assert_bitwise_equal(torch.load(tmp_path / "f.pt"), final)


def test_jit_checkpoint_on_sigterm_commits_before_it_returns_and_a_short_grace_leaves_nothing_to_trip_on(
        tmp_path, reference, monkeypatch):
    final, _ = reference
    # A grace that covers the save: JIT's checkpoint of the running step is committed, training stops.
    out = tmp_path / "out"
    stopped = stop_at(out, 12, 20, "--enable_jit_checkpoint", "True")
    # SIGTERM came before step 13 ran: JIT's checkpoint is of step 13, at its end, and training stops
    assert stopped.get("final_step") == 13, stopped["stderr"][-3000:]
    assert "taken on SIGTERM was not committed" not in stopped["stderr"]
    assert (out / "checkpoint-13" / "model.safetensors").exists(), os.listdir(out)
    begin, _ = run(out, "--resume_from_checkpoint", "True", result=tmp_path / "final.pt")
    assert begin == {"resumed_from": [13, "storage"], "start_step": 13}
    assert_bitwise_equal(torch.load(tmp_path / "final.pt"), final)

    # A grace shorter than the persist (every file write takes 2 s): no folder of step 13 appears, and
    # the same command resumes from the newest commit.
    out = tmp_path / "short"
    slow = json.dumps({"storage_factory": "tests.helpers:SlowStorage"})
    monkeypatch.setenv("FLASHCKPT_TEST_WRITE_DELAY", "0")
    run(out, "--flash_config", slow, kill_at=12)  # commits 5 and 10 at full speed, a snapshot of 12
    deadline = time.monotonic() + 60  # the saver outlives the killed script: let it finish the commit of 10
    while not (out / "checkpoint-10").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in savers_of_this_test():  # the relaunch starts a saver of its own, on the slow storage
        os.kill(pid, signal.SIGKILL)
    monkeypatch.setenv("FLASHCKPT_TEST_WRITE_DELAY", "2")
    stopped = stop_at(out, 12, 4, "--enable_jit_checkpoint", "True", "--flash_config", slow,
                      "--resume_from_checkpoint", "True")  # resumes from memory at 12, is stopped there
    assert "SIGTERM: saving a last checkpoint" in stopped["stderr"], stopped["stderr"][-3000:]
    monkeypatch.delenv("FLASHCKPT_TEST_WRITE_DELAY")
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-10", "checkpoint-5"]
    begin, _ = run(out, "--resume_from_checkpoint", "True", result=tmp_path / "final2.pt")
    assert begin == {"resumed_from": [10, "storage"], "start_step": 10}
    assert_bitwise_equal(torch.load(tmp_path / "final2.pt"), final)
