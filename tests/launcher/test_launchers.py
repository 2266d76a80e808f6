"""Plain torchrun restarts and ``flashckpt-run`` (2 CPU ranks, gloo, standalone rendezvous).

A worker that kills itself right after a memory-only snapshot at step S is restarted by the
launcher and resumes from memory at S; its final parameters equal an uninterrupted run's.
``flashckpt-run`` also persists the newest in-memory step when a worker fails or it is stopped,
and prints the failing rank's traceback.
"""

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from flashckpt_integrations.core.client import job_key, user_run_root
from flashckpt_integrations.core.layout import committed_steps
from flashckpt_integrations.core.rescue import job_slots, read_snapshots
from flashckpt_integrations.core.storage import LocalStorage
from tests.launcher.worker import state

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "ddp", "train.py")
WORKER = os.path.join(REPO, "tests", "launcher", "worker.py")
TRAIN_ARGS = ["--steps", "12", "--save-every", "2", "--persist-every", "10", "--hidden", "32", "--batch-size", "8"]
CRASH_AT = 6
KEEP_LOG = {"FLASHCKPT_SAVER_KEEP_RUN_DIR": "1"}
"""For the tests that read the saver's log once the job is over: a job that closed cleanly removes it."""


def torchrun(*options):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *options]


def flashckpt_run(*options):
    return [sys.executable, "-m", "flashckpt_integrations.launcher.run", "--standalone", "--nproc-per-node", "2",
            *options]


def job_env(**extra):
    base = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    return {**base, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def start(cmd, **env):
    return subprocess.Popen([str(c) for c in cmd], env=job_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=REPO)


def finish(proc, timeout=180):
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{proc.args[:4]} did not finish within {timeout}s:\n{output[-5000:]}")
    return proc.returncode, output


def summary(output):
    """The JSON line rank 0 of examples/ddp/train.py prints at the end."""
    lines = [line for line in output.splitlines() if line.startswith("{") and '"final_step"' in line]
    assert lines, output[-5000:]
    # the object alone: another process's log line may land on the same line right after it
    return json.JSONDecoder().raw_decode(lines[-1])[0]


def assert_same_params(path, reference):
    final = torch.load(path, weights_only=True)
    assert list(final) == list(reference)
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"


def saver_log(ckpt):
    """The saver log of the job that saves to ``ckpt`` on this (single) node."""
    (run_dir,) = glob.glob(os.path.join(user_run_root(), f"{job_key(str(ckpt))}-*"))
    with open(os.path.join(run_dir, "saver.log")) as f:
        return f.read()


def _pids_mentioning(text):
    pids = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(path.split("/")[2]))
        except OSError:
            continue
    return [pid for pid in pids if pid != os.getpid()]


@pytest.fixture
def reaper(tmp_path):
    """At teardown, kill (by pid) the launchers, workers and savers this test left behind:
    torch elastic starts workers in their own sessions, out of the launcher's process group."""
    yield
    keys = [job_key(str(tmp_path / "ckpt"))]
    for pid in _pids_mentioning(str(tmp_path)) + [p for key in keys for p in _pids_mentioning(f"/{key}-")]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def reference():
    """The final parameters of an uninterrupted run."""
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        out = os.path.join(tmp, "final.pt")
        rc, output = finish(start(torchrun() + [TRAIN, "--ckpt-dir", os.path.join(tmp, "ckpt"), "--out", out,
                                                *TRAIN_ARGS], FLASHCKPT_SHM_DIR=shm))
        assert rc == 0, output[-5000:]
        assert summary(output)["resumed_from_step"] is None
        yield torch.load(out, weights_only=True)


def test_plain_torchrun_restart_resumes_from_memory(tmp_path, reference, reaper):
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.pt"
    # Without it torch 2.13's restarted workers can read the previous attempt's keys from the shared
    # rendezvous store and fail to connect (pytorch/pytorch#135712; 2 runs of 2 failed here).
    fresh_store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    rc, output = finish(start(torchrun("--max-restarts", "1") + [TRAIN, "--ckpt-dir", ckpt, "--out", out,
                                                                  *TRAIN_ARGS, "--crash-at-step", CRASH_AT],
                              **fresh_store, **KEEP_LOG))
    assert rc == 0, output[-5000:]
    assert f"SIGKILL after the save at step {CRASH_AT}" in output
    result = summary(output)
    assert (result["resumed_from_step"], result["source"]) == (CRASH_AT, "memory"), result
    # step 6 was never committed (retention keeps 2): the restarted workers did not read storage
    assert result["committed_steps"] == [10]
    assert_same_params(out, reference)
    # one saver served both attempts: it outlived the killed workers
    assert saver_log(ckpt).count(" serving ") == 1


def test_flashckpt_run_persists_on_failure_and_restarts_from_memory(tmp_path, reference, reaper):
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.pt"
    proc = start(flashckpt_run("--max-restarts", "1", "--checkpoint-dir", ckpt)
                 + [TRAIN, "--ckpt-dir", ckpt, "--out", out, *TRAIN_ARGS, "--crash-at-step", CRASH_AT], **KEEP_LOG)
    rc, output = finish(proc)
    assert rc == 0, output[-5000:]
    assert f"rank 0 failed on host {socket.gethostname()}" in output and "(SIGKILL)" in output, output[-5000:]
    assert f"step {CRASH_AT} persisted from memory (committed" in output, output[-5000:]
    result = summary(output)
    assert (result["resumed_from_step"], result["source"]) == (CRASH_AT, "memory"), result
    assert result["committed_steps"] == [CRASH_AT, 10]
    assert torch.load(ckpt / f"step-{CRASH_AT}" / "rank-1.pt", weights_only=True)["step"] == CRASH_AT
    assert_same_params(out, reference)
    log = saver_log(ckpt)  # the launcher started the one saver, before the workers, watching itself
    assert log.count(" serving ") == 1 and f"(watching pid {proc.pid})" in log


def wait_for_progress(out, step, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        saved = []
        for rank in (0, 1):
            try:
                with open(out / f"rank-{rank}.json") as f:
                    saved.append(json.load(f)["last_saved"] or 0)
            except (OSError, ValueError):
                saved.append(0)
        if min(saved) >= step:
            return
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-5000:]
        time.sleep(0.05)


def test_flashckpt_run_commits_the_newest_memory_step_on_sigterm(tmp_path, reaper):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    os.makedirs(out)
    proc = start(flashckpt_run("--checkpoint-dir", ckpt)
                 + [WORKER, "--ckpt", ckpt, "--out", out, "--steps", "100000", "--step-sleep", "0.05"])
    wait_for_progress(out, 3, proc)
    proc.send_signal(signal.SIGTERM)  # the launcher only: it stops the workers itself
    rc, output = finish(proc, timeout=120)
    assert rc == 128 + signal.SIGTERM, output[-5000:]
    held, _ = read_snapshots(job_slots(ckpt))  # the workers are gone; their memory stays
    newest = max(set(held[0]) & set(held[1]))
    assert newest >= 3
    assert committed_steps(LocalStorage(str(ckpt))) == [newest], output[-5000:]
    assert f"stopped by SIGTERM; step {newest} persisted from memory (committed" in output
    for rank in (0, 1):
        saved = torch.load(ckpt / f"step-{newest}" / f"rank-{rank}.pt", weights_only=True)
        assert saved["step"] == newest and torch.equal(saved["w"], state(newest, rank)["w"])


def test_flashckpt_run_prints_the_failing_ranks_traceback(tmp_path, reaper):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    os.makedirs(out)
    rc, output = finish(start(flashckpt_run("--checkpoint-dir", ckpt)
                              + [WORKER, "--ckpt", ckpt, "--out", out, "--steps", "6", "--raise-at", "1:3"]))
    assert rc == 1, output[-5000:]
    header = f"flashckpt-run: rank 1 failed on host {socket.gethostname()} (node rank 0, local rank 1, "
    assert header in output, output[-5000:]
    report = output[output.index(header):].split("\nflashckpt-run:")[0]
    assert "exit code 1" in report.splitlines()[0]
    assert "    Traceback (most recent call last):" in report, report
    assert "    ValueError: injected failure at step 3 on rank 1" in report, report
    # step 2 is the newest step both ranks hold: persisted and committed when the worker failed
    assert committed_steps(LocalStorage(str(ckpt))) == [2]
    assert "step 2 persisted from memory (committed" in output


def test_launcher_options_leave_the_scripts_own_alone_and_auto_config_fills_the_rest():
    from flashckpt_integrations.launcher.run import parse_args, torchrun_argv

    argv = ["--checkpoint-dir", "/c", "--nnodes", "1", "--drain-timeout=5", "train.py", "--checkpoint-dir", "/x",
            "--job-id", "j"]
    args = parse_args(argv)
    assert (args.checkpoint_dir, args.drain_timeout, args.job_id, args.nnodes) == ("/c", 5.0, None, "1")
    assert (args.training_script, args.training_script_args) == ("train.py", argv[-4:])
    assert torchrun_argv(argv, args) == ["--nnodes", "1", "train.py", "--checkpoint-dir", "/x", "--job-id", "j"]

    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.0.0.1",
           "PET_MASTER_PORT": "29555"}
    filled = parse_args(["--auto-config", "--checkpoint-dir", "/c", "--nproc-per-node", "2", "train.py", "--lr", "1"],
                        env=env)
    assert (filled.nnodes, filled.nproc_per_node, filled.node_rank) == ("2", "2", 1)  # what is given wins
    assert (filled.master_addr, filled.master_port, filled.checkpoint_dir) == ("10.0.0.1", 29555, "/c")
    assert (filled.training_script, filled.training_script_args) == ("train.py", ["--lr", "1"])


def test_flashckpt_run_waits_for_in_flight_persisting_before_it_exits(tmp_path, reaper):
    from tests.distributed.worker import state as persisted_state

    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    os.makedirs(out)
    worker = [os.path.join(REPO, "tests", "distributed", "worker.py"), "--ckpt", ckpt, "--out", out,
              "--actions", "save:1:persist", "--storage-factory", "tests.helpers:SlowStorage"]
    # The ranks ask for a persist and exit at once (no wait, no close); each file takes 2 s to write.
    rc, output = finish(start(flashckpt_run("--checkpoint-dir", ckpt) + worker, FLASHCKPT_TEST_WRITE_DELAY="2"))
    assert rc == 0, output[-5000:]
    assert "flashckpt-run: waiting for in-flight persisting: " in output, output[-5000:]
    assert committed_steps(LocalStorage(str(ckpt))) == [1]  # committed before the launcher exited
    for rank in (0, 1):
        saved = torch.load(ckpt / "step-1" / f"rank-{rank}.pt", weights_only=True)
        assert torch.equal(saved["w"], persisted_state(1, rank)["w"]) and saved["step"] == 1
