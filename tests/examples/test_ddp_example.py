"""The DDP example end to end: crash after a memory-only save, resume from memory, same result.

Runs ``examples/ddp/demo.py`` (three torchrun launches of 2 CPU ranks each) in a subprocess.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "examples", "ddp", "demo.py")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _load_demo():
    spec = importlib.util.spec_from_file_location("flashckpt_ddp_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pids_mentioning(text: str) -> list[int]:
    """Processes (not this one) whose command line contains ``text``."""
    pids = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        pid = int(path.split("/")[2])
        if pid == os.getpid():
            continue
        try:
            with open(path, "rb") as f:
                if text.encode() in f.read():
                    pids.append(pid)
        except OSError:
            continue
    return pids


@pytest.fixture
def private_shm():
    """Slots in a private directory on the same tmpfs, so nothing else can touch (or see) them."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm")
    path = tempfile.mkdtemp(prefix="ddp-example-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ddp_demo_resumes_from_memory_bit_identical(tmp_path, private_shm):
    demo = _load_demo()
    workdir = tmp_path / "demo"
    summary_path = tmp_path / "summary.json"
    env = {**os.environ, "FLASHCKPT_SHM_DIR": private_shm, "PYTHONUNBUFFERED": "1"}
    ckpt_dirs = [str(workdir / "ckpt-crash"), str(workdir / "ckpt-reference")]
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, DEMO, "--workdir", str(workdir), "--summary-json", str(summary_path), "--timeout", "80"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"demo.py did not finish within 240s:\n{output[-5000:]}")
    finally:
        leftovers = _reap(str(workdir), ckpt_dirs, demo)
    elapsed = time.monotonic() - started

    assert proc.returncode == 0, output[-5000:]
    assert "demo OK" in output, output[-5000:]
    assert not leftovers, f"processes left behind (now killed): {leftovers}"

    summary = json.loads(summary_path.read_text())
    resumed, reference = summary["resumed"], summary["reference"]
    assert resumed["source"] == "memory", resumed
    assert resumed["resumed_from_step"] == demo.CRASH_AT, resumed
    assert resumed["final_step"] == reference["final_step"] == demo.STEPS
    assert reference["resumed_from_step"] is None
    assert resumed["committed_steps"] == reference["committed_steps"] == [demo.PERSIST_EVERY, demo.STEPS]
    assert reference["saves"] == demo.STEPS // demo.SAVE_EVERY
    assert reference["save_ms_mean"] > 0 and reference["torch_save_ms_mean"] > 0

    final_resumed = torch.load(summary["resumed_out"], weights_only=True)
    final_reference = torch.load(summary["reference_out"], weights_only=True)
    assert list(final_resumed) == list(final_reference)
    for name, tensor in final_resumed.items():
        assert torch.equal(tensor, final_reference[name]), f"{name} differs after the crash and resume"
    # the model did train (the comparison is not between two untouched initialisations)
    torch.manual_seed(1234)
    initial = demo_train_module().build_model(2560).state_dict()
    assert not torch.equal(initial["1.weight"], final_reference["1.weight"])

    # the relaunch's clean close freed the crashed job's memory; nothing of either job is left
    assert not os.listdir(private_shm), os.listdir(private_shm)
    print(f"demo took {elapsed:.1f}s")


def demo_train_module():
    spec = importlib.util.spec_from_file_location("flashckpt_ddp_train", os.path.join(REPO, "examples", "ddp",
                                                                                      "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reap(workdir: str, ckpt_dirs: list[str], demo) -> list[str]:
    """Kill (by pid) whatever of this test is still running; return what there was."""
    found = []
    deadline = time.monotonic() + 15  # savers exit on their own shortly after their launcher
    while True:
        launchers = _pids_mentioning(workdir)  # torchrun and the ranks: their argv holds the ckpt dirs
        savers = [pid for d in ckpt_dirs for pid in demo.job_leftovers(d)[0]]
        if not (launchers or savers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in launchers + savers:
        found.append(f"pid {pid}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found
