"""A node lost while a persist is in flight never hangs the job: two nodes simulated on loopback
(two torchrun agents, one rank each, their own node id, shared-memory directory and saver), a
memory snapshot every step and a persist every 5. Node 1's storage is slow (each data file
waits 30 s), so node 0's saver has persisted rank 0's file of step 5 and the commit waits for
rank 1's. Node 1 is then lost whole (rank, agent, saver, memory, run directory). Node 0's rank
fails on its next collective and exits within seconds (it does not wait for a commit the lost
rank can never complete), so its launcher ends; the relaunched job (node 1 empty) attaches to
node 0's surviving saver, whose stale commit gives way, and trains to the end with every
persist committed and the parameters of an uninterrupted run. Nothing torn is left behind."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import time

import pytest
import torch

from flashckpt_integrations.core.client import job_key, private_dir, run_dir_for
from tests.distributed.launch import HERE, env, free_port, torchrun_cmd
from tests.distributed.nodes import kill_node, wait_for
from tests.distributed.test_replica_restore import assert_like_uninterrupted
from tests.helpers import kill_savers, saver_pids

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

STEPS = 30
EXIT_BOUND_S = 30.0
"""How long node 0's launcher may take to end once node 1 is gone (was: until commit_timeout_s)."""
RELAUNCH_BOUND_S = 150.0
"""How long the relaunched job may take to train to the end (30 small steps and 6 persists)."""


def launch(ckpt, out, shm, delays) -> list[subprocess.Popen]:
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = torchrun_cmd(1, port, nnodes=2, node_rank=node) + [
            os.path.join(HERE, "replica_worker.py"), "--ckpt", str(ckpt), "--out", str(out), "--steps", str(STEPS),
            "--persist-every", "5", "--step-sleep", "0.05", "--storage-factory", "tests.helpers:SlowStorage"]
        node_env = env(FLASHCKPT_NODE_ID=f"node{node}", FLASHCKPT_SHM_DIR=shm[node],
                       FLASHCKPT_TEST_WRITE_DELAY=str(delays[node]))
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def record(out, rank: int) -> dict:
    with open(os.path.join(out, f"rank-{rank}.json")) as f:
        return json.load(f)


def test_a_node_lost_mid_persist_neither_hangs_the_exit_nor_the_relaunch(tmp_path, private_shm_dir):
    ckpt, job = tmp_path / "ckpt", job_key(str(tmp_path / "ckpt"))
    shm = [private_dir(os.path.join(private_shm_dir, f"node{n}")) for n in (0, 1)]
    run_dirs = [run_dir_for(job, job_key(f"node{n}")[:8]) for n in (0, 1)]
    markers = ckpt / ".flashckpt" / "steps" / "5"
    try:
        first = launch(ckpt, tmp_path / "run1", shm, delays=(0, 30))
        rank1_up = tmp_path / "run1" / "rank-1.json"
        wait_for(lambda: glob.glob(str(markers / "rank-0.*.done")) and rank1_up.exists(), "rank 0's files of step 5",
                 first)
        assert not glob.glob(str(markers / "rank-1.*")), "node 1's slow write finished before the loss"
        kill_node([record(tmp_path / "run1", 1)], first[1])  # node 1 is lost whole
        shutil.rmtree(shm[1])
        shutil.rmtree(run_dirs[1], ignore_errors=True)
        lost = time.monotonic()
        try:
            output, _ = first[0].communicate(timeout=EXIT_BOUND_S + 60)
        except subprocess.TimeoutExpired as exc:
            tail = (exc.output or b"")[-3000:]
            raise AssertionError(f"node 0's launcher did not end after the loss:\n{tail!r}") from exc
        took = time.monotonic() - lost
        assert first[0].returncode != 0, output[-3000:]
        assert took < EXIT_BOUND_S, f"node 0's launcher took {took:.0f}s to end after the loss:\n{output[-3000:]}"
        assert saver_pids(run_dirs[0]), "node 0's saver (and its memory) should outlive the failure"

        private_dir(shm[1])  # the replacement node: no memory
        started = time.monotonic()
        second = launch(ckpt, tmp_path / "run2", shm, delays=(0, 0))
        for node, proc in enumerate(second):
            output, _ = proc.communicate(timeout=RELAUNCH_BOUND_S + 60)
            assert proc.returncode == 0, f"node {node}:\n{output[-4000:]}"
        took = time.monotonic() - started
        assert took < RELAUNCH_BOUND_S, f"the relaunch took {took:.0f}s"
        for rank in (0, 1):
            rec = record(tmp_path / "run2", rank)
            assert rec["committed"], rec
            assert [s["status"] for s in rec["saves"]].count("skipped") == 0, rec["saves"]
        assert_like_uninterrupted(tmp_path / "run2", STEPS, 2)
        # The stale commit of step 5 gave way (a failure record) or was superseded by the new attempt's
        # save of step 5; every committed step loads whole.
        commits = sorted(int(os.path.basename(os.path.dirname(p)))
                         for p in glob.glob(str(ckpt / ".flashckpt" / "steps" / "*" / "COMMITTED")))
        assert commits and commits[-1] == STEPS, commits
        for step in commits:
            for rank in (0, 1):
                state = torch.load(ckpt / f"step-{step}" / f"rank-{rank}.pt", weights_only=False)
                assert state["step"] == step
    finally:
        for run_dir in run_dirs:
            kill_savers(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
