"""Restarts as users do them, with a script shaped like HF's run_clm.py (tests/hf/example_script.py):
the same command again, ``--resume_from_checkpoint True`` from the command line, an explicit older
checkpoint, and ``rm -rf`` of the output directory before the relaunch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.helpers import REPO  # noqa: E402
from tests.hf.common import assert_bitwise_equal  # noqa: E402

SCRIPT = os.path.join(REPO, "tests", "hf", "example_script.py")
STEPS, SAVE_EVERY, MEMORY_EVERY = 20, 5, 3  # commits 5, 10, 15, 20; memory-only snapshots 3, 6, 9, 12, 18


def run(out, *args, kill_at=None, result=None):
    cmd = [sys.executable, SCRIPT, "--output_dir", str(out), "--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY),
           "--flash_memory_interval", str(MEMORY_EVERY), "--per_device_train_batch_size", "4",
           "--learning_rate", "1e-3", "--logging_steps", "1", "--seed", "42", "--report_to", "none", "--use_cpu",
           "True", "--disable_tqdm", "True", "--dataloader_num_workers", "0", *args]
    if kill_at is not None:
        cmd += ["--kill_at", str(kill_at)]
    if result is not None:
        cmd += ["--result", str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"})
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
