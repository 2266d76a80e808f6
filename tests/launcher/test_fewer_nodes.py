"""A lost node with no spare, under ``flashckpt-run --nnodes 1:2``: two simulated nodes (two launchers
on loopback, torch's c10d rendezvous, 2 ranks each, own shared memory and saver, one peer replica)
train FSDP2 + AdamW through the DCP adapter. Node 1 dies whole and its memory is gone; node 0's
workers fail at their next collective, its launcher restarts them on the one node left, and the 2
new ranks restore the 4 old ranks' newest step from node 0's memory (its slots and its replicas of
node 1's ranks), then train to the end. Before that, ``flashckpt ls`` shows the step as held for
every old rank on node 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from flashckpt_integrations import cli
from flashckpt_integrations.core.client import job_key, private_dir, run_dir_for
from tests.distributed.launch import REPO, free_port
from tests.distributed.nodes import holds, wait_for
from tests.helpers import kill_savers
from tests.launcher.cluster import reap

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

SCRIPT = os.path.join(REPO, "tests", "dcp", "fsdp_train.py")
HOLD, STEPS = 7, 10


def launch(ckpt, out, shm) -> list[subprocess.Popen]:
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "flashckpt_integrations.launcher.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fewer-nodes",
               "--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout=5,join_timeout=120", "--max-restarts", "2",
               "--monitor-interval", "0.1", "--checkpoint-dir", str(ckpt),
               SCRIPT, "--ckpt", str(ckpt), "--out", str(out), "--steps", str(STEPS), "--resume", "--snapshot-every",
               "1", "--persist-every", "5", "--replicas", "1", "--hold-at", str(HOLD)]
        node_env = {**base, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "FLASHCKPT_NODE_ID": f"node{node}", "FLASHCKPT_SHM_DIR": shm[node]}
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True, cwd=REPO))
    return procs


def test_a_lost_node_restarts_on_the_node_left_and_restores_from_memory(tmp_path, private_shm_dir, capsys):
    ckpt, out, job = tmp_path / "ckpt", tmp_path / "out", job_key(str(tmp_path / "ckpt"))
    out.mkdir()
    shm = [private_dir(os.path.join(private_shm_dir, f"node{n}")) for n in (0, 1)]
    run_dirs = [run_dir_for(job, job_key(f"node{n}")[:8]) for n in (0, 1)]
    nodes = launch(ckpt, out, shm)
    try:
        wait_for(lambda: all((out / f"held-{r}").exists() for r in range(4)), f"step {HOLD}", nodes, 300)
        wait_for(lambda: all(HOLD in holds(shm[0], job, 0).get(r, set()) for r in (2, 3)),
                 "node 0's replicas of node 1's ranks", nodes)
        capsys.readouterr()
        assert cli.main(["ls", str(ckpt), "--shm-dir", shm[0]]) == 0
        assert f"step {HOLD:<6} saved by 4 ranks: every rank" in capsys.readouterr().out

        old = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
        os.killpg(nodes[1].pid, signal.SIGKILL)  # node 1 goes down whole: its launcher, workers and saver,
        for rec in old[2:]:
            os.kill(rec["pid"], signal.SIGKILL)
        kill_savers(old[2]["run_dir"])
        shutil.rmtree(shm[1])  # and its memory
        nodes[1].wait(30)
        (out / "go").touch()  # node 0's workers go on, and fail at their next collective

        output, _ = nodes[0].communicate(timeout=400)
        assert nodes[0].returncode == 0, output[-6000:]
        new = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
        for rec in new:
            assert rec["world"] == 2 and rec["events"][0] == {"load": HOLD, "source": "memory"}, rec
            assert [e["save"] for e in rec["events"][1:]] == list(range(HOLD + 1, STEPS + 1)), rec
        assert f"resharded step {HOLD} from the memory of a job of 4 ranks onto 2 ranks" in output
        assert (ckpt / "latest").read_text().strip() == str(STEPS)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        reap(out)
        for run_dir in run_dirs:
            kill_savers(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
