"""Preemption under plain torchrun loses nothing: a 2-rank job (on one node, or on two simulated
nodes with a saver each) takes a memory snapshot every step and persists every 10; at step 13
every process of the job (the torchrun agents, both ranks, the savers) gets SIGTERM, as Slurm or
``kill`` deliver it. The savers persist step 13 from memory and the committer commits it within
the grace period; the nodes' memory is then wiped and the same command resumes from storage at
step 13 and ends with the parameters of an uninterrupted run, bit for bit."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from tests.distributed.launch import HERE, env, free_port, torchrun_cmd
from tests.distributed.nodes import wait_for
from tests.distributed.test_replica_restore import assert_like_uninterrupted
from tests.helpers import kill_savers, saver_pids

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS, STOP_AT, GRACE_S = 20, 13, 20


def launch(ckpt, out, shm, nodes: int, *extra: str) -> list[subprocess.Popen]:
    os.makedirs(out, exist_ok=True)
    port, procs = free_port(), []
    for node in range(nodes):
        cmd = torchrun_cmd(2 // nodes, port, nnodes=nodes, node_rank=node) + [
            os.path.join(HERE, "replica_worker.py"), "--ckpt", str(ckpt), "--out", str(out), "--steps", str(STEPS),
            "--persist-every", "10", "--replicas", "0", *extra]
        node_env = env(FLASHCKPT_NODE_ID=f"node{node}", FLASHCKPT_SHM_DIR=shm[node], FLASHCKPT_GRACE_S=str(GRACE_S),
                       FLASHCKPT_SAVER_KEEP_RUN_DIR="1")
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def records(out) -> list[dict]:
    result = []
    for rank in (0, 1):
        with open(os.path.join(out, f"rank-{rank}.json")) as f:
            result.append(json.load(f))
    return result


@pytest.mark.parametrize("nodes", [1, 2])
def test_sigterm_to_every_process_commits_the_newest_snapshot_and_the_job_resumes_from_it(tmp_path, private_shm_dir,
                                                                                          nodes):
    ckpt = tmp_path / "ckpt"
    shm = [os.path.join(private_shm_dir, f"node{n}") for n in range(nodes)]
    for path in shm:
        os.makedirs(path, mode=0o700)
    run_dirs: list[str] = []
    try:
        job = launch(ckpt, tmp_path / "run1", shm, nodes, "--pause-at", str(STOP_AT))
        wait_for(lambda: all(os.path.exists(tmp_path / "run1" / f"paused-{r}") for r in (0, 1)),
                 f"both ranks at step {STOP_AT}", job)
        wait_for(lambda: (ckpt / ".flashckpt" / "steps" / "10" / "COMMITTED").exists(), "the commit of step 10", job)
        recs = records(tmp_path / "run1")
        run_dirs = sorted({r["run_dir"] for r in recs})
        savers = [pid for run_dir in run_dirs for pid in saver_pids(run_dir)]
        assert len(savers) == nodes and [s["step"] for s in recs[0]["saves"]][-1] == STOP_AT
        stopped = time.monotonic()
        for pid in [*(p.pid for p in job), *(r["pid"] for r in recs), *savers]:  # every process at once
            os.kill(pid, signal.SIGTERM)
        for proc in job:
            proc.communicate(timeout=60)
        wait_for(lambda: not any(saver_pids(d) for d in run_dirs), "the savers to finish and exit", [],
                 timeout=GRACE_S + 10)
        assert time.monotonic() - stopped < GRACE_S, "a saver outlived the grace period"
        commits = sorted(int(p.split(os.sep)[-2]) for p in glob.glob(str(ckpt / ".flashckpt" / "steps" / "*" /
                                                                            "COMMITTED")))
        assert commits == [10, STOP_AT], commits
        for rank in (0, 1):  # torch's own loader reads the rescued files
            assert torch.load(ckpt / f"step-{STOP_AT}" / f"rank-{rank}.pt", weights_only=False)["step"] == STOP_AT
        for path in shm:  # the nodes are gone: nothing of their memory is left
            for name in os.listdir(path):
                os.unlink(os.path.join(path, name))

        second = launch(ckpt, tmp_path / "run2", shm, nodes)
        for proc in second:
            output, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, output[-4000:]
        for rec in records(tmp_path / "run2"):
            assert (rec["load"]["step"], rec["load"]["source"]) == (STOP_AT, "storage"), rec["load"]
        assert_like_uninterrupted(tmp_path / "run2", STEPS, 2)
    finally:
        for run_dir in run_dirs:
            kill_savers(run_dir)


@pytest.mark.parametrize("signalled", ["every process", "torchrun only"])
def test_a_loop_with_stop_signal_persists_the_step_it_was_in_and_the_job_resumes_from_it(tmp_path, private_shm_dir,
                                                                                         signalled):
    """StopSignal: SIGTERM while the ranks are in step 14 (their snapshot of 13 taken): they finish
    step 14, save it persisting and leave; the saver serves that save. ``every process``: the saver
    too, which exits once it is done; ``torchrun only`` (a container's first process): torchrun
    passes SIGTERM on to its workers and waits for them."""
    ckpt, shm = tmp_path / "ckpt", [os.path.join(private_shm_dir, "node0")]
    os.makedirs(shm[0], mode=0o700)
    run_dirs: list[str] = []
    try:
        job = launch(ckpt, tmp_path / "run1", shm, 1, "--pause-at", str(STOP_AT), "--last-save-on-sigterm")
        wait_for(lambda: all(os.path.exists(tmp_path / "run1" / f"paused-{r}") for r in (0, 1)),
                 f"both ranks at step {STOP_AT}", job)
        wait_for(lambda: (ckpt / ".flashckpt" / "steps" / "10" / "COMMITTED").exists(), "the commit of step 10", job)
        recs = records(tmp_path / "run1")
        run_dirs = sorted({r["run_dir"] for r in recs})
        everything = [job[0].pid, *(r["pid"] for r in recs), *saver_pids(run_dirs[0])]
        for pid in everything if signalled == "every process" else [job[0].pid]:
            os.kill(pid, signal.SIGTERM)
        output, _ = job[0].communicate(timeout=60)
        if signalled == "every process":
            wait_for(lambda: not saver_pids(run_dirs[0]), "the saver to finish and exit", [], timeout=GRACE_S + 10)
        else:  # torchrun has exited once its workers were done: the container, and the node, go now
            kill_savers(run_dirs[0])
        for rec in records(tmp_path / "run1"):
            assert rec.get("stopped_at") == STOP_AT + 1 and rec.get("committed") is True, (rec, output[-3000:])
        commits = sorted(int(p.split(os.sep)[-2]) for p in glob.glob(str(ckpt / ".flashckpt" / "steps" / "*" /
                                                                            "COMMITTED")))
        assert commits == [10, STOP_AT + 1], commits
        for name in os.listdir(shm[0]):  # the node is gone
            os.unlink(os.path.join(shm[0], name))

        (second,) = launch(ckpt, tmp_path / "run2", shm, 1)
        output, _ = second.communicate(timeout=180)
        assert second.returncode == 0, output[-4000:]
        for rec in records(tmp_path / "run2"):
            assert (rec["load"]["step"], rec["load"]["source"]) == (STOP_AT + 1, "storage"), rec["load"]
        assert_like_uninterrupted(tmp_path / "run2", STEPS, 2)
    finally:
        for run_dir in run_dirs:
            kill_savers(run_dir)


@pytest.mark.parametrize("how", ["preempted", "crashed"])
def test_sigterm_to_torchrun_alone_persists_the_newest_snapshot_but_a_crash_restarts_at_once(tmp_path, private_shm_dir,
                                                                                             how):
    """No handler of the script's own. ``preempted``: SIGTERM to torchrun only (a container's first
    process); torchrun passes it on to its workers, which ask their saver to persist the newest
    snapshot (step 13, memory only) and die once it is committed; torchrun then exits, and the
    container with the saver in it. ``crashed``: rank 1 is SIGKILLed, so torchrun SIGTERMs rank 0:
    that is a failure, not a stop: rank 0 dies at once, nothing is persisted, and the relaunch
    resumes from memory as after any crash."""
    ckpt, shm = tmp_path / "ckpt", [os.path.join(private_shm_dir, "node0")]
    os.makedirs(shm[0], mode=0o700)
    run_dirs: list[str] = []
    try:
        job = launch(ckpt, tmp_path / "run1", shm, 1, "--pause-at", str(STOP_AT))
        wait_for(lambda: all(os.path.exists(tmp_path / "run1" / f"paused-{r}") for r in (0, 1)),
                 f"both ranks at step {STOP_AT}", job)
        wait_for(lambda: (ckpt / ".flashckpt" / "steps" / "10" / "COMMITTED").exists(), "the commit of step 10", job)
        recs = records(tmp_path / "run1")
        run_dirs = sorted({r["run_dir"] for r in recs})
        stopped = time.monotonic()
        if how == "preempted":
            os.kill(job[0].pid, signal.SIGTERM)
        else:
            os.kill(recs[1]["pid"], signal.SIGKILL)
        output, _ = job[0].communicate(timeout=60)
        took = time.monotonic() - stopped
        commits = sorted(int(p.split(os.sep)[-2]) for p in glob.glob(str(ckpt / ".flashckpt" / "steps" / "*" /
                                                                            "COMMITTED")))
        if how == "preempted":
            kill_savers(run_dirs[0])  # torchrun has exited: the container, and the node, go now
            assert commits == [10, STOP_AT], (commits, output[-3000:])
            assert "persisted the newest snapshot" in output, output[-3000:]
            for name in os.listdir(shm[0]):  # the node is gone
                os.unlink(os.path.join(shm[0], name))
            expected = (STOP_AT, "storage")
        else:
            assert commits == [10], (commits, output[-3000:])
            assert took < 15, f"torchrun took {took:.0f}s to end after the crash:\n{output[-3000:]}"
            expected = (STOP_AT, "memory")

        (second,) = launch(ckpt, tmp_path / "run2", shm, 1)
        output, _ = second.communicate(timeout=180)
        assert second.returncode == 0, output[-4000:]
        for rec in records(tmp_path / "run2"):
            assert (rec["load"]["step"], rec["load"]["source"]) == expected, rec["load"]
        assert_like_uninterrupted(tmp_path / "run2", STEPS, 2)
    finally:
        for run_dir in run_dirs:
            kill_savers(run_dir)
