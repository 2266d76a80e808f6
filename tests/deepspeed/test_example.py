"""examples/deepspeed/train.py end to end: crash under the deepspeed launcher, relaunch, resume from memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

pytest.importorskip("deepspeed")

import torch  # noqa: E402

from tests.deepspeed.launch import ds_env  # noqa: E402
from tests.distributed.launch import REPO, free_port, torchrun_cmd  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TRAIN = os.path.join(REPO, "examples", "deepspeed", "train.py")


def deepspeed_cmd() -> list[str]:
    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    return [launcher, "--num_gpus", "2", "--master_port", str(free_port())]


def run(cmd: list[str], *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run(cmd + [TRAIN, *args], env=ds_env(), capture_output=True, text=True, timeout=180, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, json.loads(lines[-1]) if lines else None


def test_example_crash_and_resume_from_memory(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    crashed, _ = run(deepspeed_cmd(), "--ckpt-dir", ckpt, "--crash-at-step", "7")
    assert crashed.returncode != 0
    assert "[rank 0] step 7 " in crashed.stdout, crashed.stdout[-3000:] + crashed.stderr[-3000:]

    resumed, summary = run(deepspeed_cmd(), "--ckpt-dir", ckpt, "--out", str(tmp_path / "resumed.pt"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert summary["resumed_from"] == [7, "memory"] and summary["final_step"] == 12, summary
    assert 10 in summary["committed_steps"]
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "global_step10"

    reference, ref_summary = run(torchrun_cmd(2, free_port()), "--ckpt-dir", str(tmp_path / "reference"),
                                 "--out", str(tmp_path / "reference.pt"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert ref_summary["resumed_from"] is None and ref_summary["committed_steps"] == [5, 10]
    ours, theirs = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "reference.pt")
    assert list(ours) == list(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
