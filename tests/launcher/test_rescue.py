"""Persisting the newest in-memory step on demand (``core.rescue``) and ``flashckpt persist``."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import torch

from flashckpt_integrations.core.layout import Layout, commit_record, committed_steps, read_json
from flashckpt_integrations.core.rescue import (
    RescueStatus,
    job_slots,
    persist_newest,
    read_snapshots,
    run_dir_slots,
)
from flashckpt_integrations.core.storage import LocalStorage
from tests.distributed.launch import env, free_port, torchrun_cmd, worker
from tests.distributed.worker import state as worker_state
from tests.helpers import marker_names


def state(step, rank):
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {"w": torch.randn(128, 64, generator=g), "step": step}


def two_ranks(make_checkpointer, ckpt, **kwargs):
    """Rank 0 and rank 1 of a 2-rank job, in this process (saving needs no collective)."""
    return [make_checkpointer(ckpt, rank=rank, world_size=2, **kwargs) for rank in (0, 1)]


def assert_files(ckpt, step, expected=state):
    for rank in (0, 1):
        saved = torch.load(ckpt / f"step-{step}" / f"rank-{rank}.pt", weights_only=True)
        want = expected(step, rank)
        assert list(saved) == list(want), rank
        for key, value in want.items():
            same = torch.equal(saved[key], value) if isinstance(value, torch.Tensor) else saved[key] == value
            assert same, (rank, key)


def test_persists_the_newest_step_every_rank_holds_and_never_a_partial_one(make_checkpointer, tmp_path):
    ckpt = tmp_path / "ckpt"
    ranks = two_ranks(make_checkpointer, ckpt)
    for ck in ranks:
        ck.prepare(state(1, ck.rank))  # both slots exist from here on
        assert ck.save(1, state(1, ck.rank), persist=False).ok
    assert ranks[0].save(2, state(2, 0), persist=False).ok  # rank 1 never took step 2
    # the slots, found by the job's name in /dev/shm or from the records in the saver's run directory
    assert run_dir_slots(ranks[0].run_dir) == {r: ck.slot_paths for r, ck in enumerate(ranks)} == job_slots(ckpt)
    progress = []
    result = persist_newest(job_slots(ckpt), progress=lambda done, total: progress.append((done, total)))
    assert (result.status, result.step, result.ranks) == (RescueStatus.COMMITTED, 1, [0, 1]), result
    assert "step 2 is held complete by ranks [0] only (ranks [1] lack it)" in result.reason
    assert committed_steps(LocalStorage(str(ckpt))) == [1]
    assert_files(ckpt, 1)
    assert result.bytes_written >= 2 * 128 * 64 * 4 and progress[-1][0] == result.bytes_written
    assert all(done <= total for done, total in progress)

    again = persist_newest(job_slots(ckpt))
    assert again.status is RescueStatus.NOTHING and again.step is None
    assert "held complete by ranks [0] only" in again.reason

    assert ranks[1].save(2, state(2, 1), persist=False).ok
    third = persist_newest(job_slots(ckpt))
    assert (third.status, third.step) == (RescueStatus.COMMITTED, 2), third
    assert_files(ckpt, 2)
    assert (ckpt / "latest").read_text().strip() == "2"
    nothing = persist_newest(job_slots(ckpt))
    assert nothing.status is RescueStatus.NOTHING and "not newer than the newest commit (2)" in nothing.reason
    assert persist_newest({}).status is RescueStatus.NOTHING


def test_a_staged_layouts_files_count_as_written(make_checkpointer, tmp_path):
    """Files staged under .flashckpt/staging/ (the HF Trainer's layout) are data, not markers."""
    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt, layout=Layout(step_dir="checkpoint-{step}", tracker=None, staging=True))
    assert ck.save(3, state(3, 0), persist=False).ok
    assert ck.wait_for_snapshot() is None  # a first save is sealed once its attempt is recorded
    result = persist_newest(job_slots(ckpt))
    assert (result.status, result.step) == (RescueStatus.COMMITTED, 3), result
    assert torch.equal(torch.load(ckpt / "checkpoint-3" / "rank-0.pt")["w"], state(3, 0)["w"])
    assert result.bytes_written >= 128 * 64 * 4, result


def test_each_node_persists_its_ranks_and_rank_0s_node_commits(make_checkpointer, tmp_path):
    ckpt = tmp_path / "ckpt"
    for ck in two_ranks(make_checkpointer, ckpt):
        assert ck.save(4, state(4, ck.rank), persist=False).ok
        assert ck.wait_for_snapshot() is None  # rank 0's first save is sealed once its record is written
    slots = job_slots(ckpt)
    other_node = persist_newest({1: slots[1]})  # a node that holds rank 1 only
    assert (other_node.status, other_node.step, other_node.ranks) == (RescueStatus.PERSISTED, 4, [1])
    assert "the node that holds rank 0 commits" in other_node.reason
    assert committed_steps(LocalStorage(str(ckpt))) == []
    first_node = persist_newest({0: slots[0]}, commit_timeout=30)
    assert (first_node.status, first_node.step, first_node.ranks) == (RescueStatus.COMMITTED, 4, [0])
    assert committed_steps(LocalStorage(str(ckpt))) == [4]
    assert_files(ckpt, 4)


def test_meets_a_saver_persisting_the_same_snapshot(make_checkpointer, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_TEST_WRITE_DELAY", "1")  # each data file takes a second to write
    ckpt = tmp_path / "ckpt"
    ranks = two_ranks(make_checkpointer, ckpt, storage_factory="tests.helpers:SlowStorage")
    saves = [ck.save(3, state(3, ck.rank)) for ck in ranks]  # persist=True: the saver writes them too
    result = persist_newest(job_slots(ckpt))
    # Whoever writes a rank's files first, the other finds them durable (same seq) and moves on;
    # had the saver committed before the call even looked, there would be nothing left to do.
    assert result.ok and result.status in (RescueStatus.COMMITTED, RescueStatus.NOTHING), result
    assert result.status is RescueStatus.NOTHING or result.step == 3
    assert all(save.wait(60).committed for save in saves)
    assert committed_steps(LocalStorage(str(ckpt))) == [3]
    held, _ = read_snapshots(job_slots(ckpt))
    storage = LocalStorage(str(ckpt))
    for rank in (0, 1):  # the durable files are those of the very snapshots in memory
        sid = commit_record(storage, 3)["sid"]
        assert read_json(storage, Layout().rank_marker(3, rank, sid=sid))["seq"] == held[rank][3].seq
    assert marker_names(ckpt / ".flashckpt" / "steps" / "3") == ["COMMITTED", "rank-0.done", "rank-1.done"]
    assert_files(ckpt, 3)


def test_flashckpt_persist_commits_a_killed_jobs_memory(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    os.makedirs(out)
    cmd = torchrun_cmd(2, free_port()) + worker(ckpt, out, "save:1:memory,save:2:memory,mark:saved,await:never")
    job = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(out / f"saved-{rank}") for rank in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:]
            time.sleep(0.05)
    finally:  # the whole job dies: workers (in their own sessions) and torchrun
        for pid in worker_pids(out):
            _kill(pid)
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate(timeout=30)
    assert committed_steps(LocalStorage(str(ckpt))) == []

    shm = ["--shm-dir", os.environ["FLASHCKPT_SHM_DIR"]]
    done = subprocess.run([sys.executable, "-m", "flashckpt_integrations.cli", *shm, "persist", str(ckpt)],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("committed: step 2 is committed"), done.stdout
    assert "persisting [" in done.stderr and "100%" in done.stderr
    assert committed_steps(LocalStorage(str(ckpt))) == [2]
    assert_files(ckpt, 2, expected=worker_state)

    nothing = subprocess.run([sys.executable, "-m", "flashckpt_integrations.cli", *shm, "persist", str(ckpt)],
                             env=env(), capture_output=True, text=True, timeout=120)
    assert nothing.returncode == 0 and nothing.stdout.startswith("nothing:"), nothing.stdout + nothing.stderr


def worker_pids(out):
    """Pids of the ranks that recorded themselves in ``out`` (the tests' workers write rank-<r>.json)."""
    pids = []
    for path in glob.glob(os.path.join(out, "rank-*.json")):
        with open(path) as f:
            pids.append(json.load(f)["pid"])
    return pids


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
