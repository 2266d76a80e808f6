"""Two nodes simulated on one host: two torchrun agents, each with its own node id and saver,
one shared storage directory. The commit happens once, after the ranks of both nodes are durable."""

import glob
import os
import signal
import subprocess
import time

import pytest

from tests.distributed.launch import env, free_port, records, torchrun_cmd, worker
from tests.helpers import saver_pids

pytestmark = pytest.mark.distributed


def launch_nodes(ckpt, out, actions, extra=(), node_env=({}, {})):
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = torchrun_cmd(1, port, nnodes=2, node_rank=node) + worker(ckpt, out, actions, *extra)
        procs.append(subprocess.Popen(cmd, env=env(FLASHCKPT_NODE_ID=f"node{node}", **node_env[node]),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def committed_lines(run_dir):
    with open(os.path.join(run_dir, "saver.log")) as f:
        return [line for line in f if " committed (" in line]


def test_commit_once_after_both_nodes(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    keep_logs = {"FLASHCKPT_SAVER_KEEP_RUN_DIR": "1"}  # read below, after a job that closed cleanly
    procs = launch_nodes(ckpt, out, "save:1:persist,wait,save:2:persist,wait,close", node_env=(keep_logs, keep_logs))
    for proc in procs:
        output, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, output[-3000:]
    recs = records(out)
    assert recs[0]["run_dir"] != recs[1]["run_dir"], "each node runs its own saver"
    for rec in recs:
        assert [e.get("committed") for e in rec["events"] if "wait" in e] == [True, True]
    node0, node1 = (committed_lines(r["run_dir"]) for r in recs)
    assert len(node0) == 2 and node1 == [], "only the saver of global rank 0 commits, once per step"
    assert sorted(os.listdir(ckpt / "step-2")) == ["rank-0.pt", "rank-1.pt"]
    assert (ckpt / "latest").read_text().strip() == "2"


def test_killing_one_nodes_saver_mid_persist_keeps_the_previous_commit(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    extra = ("--storage-factory", "tests.helpers:SlowStorage", "--commit-timeout", "8")
    slow = ({"FLASHCKPT_TEST_WRITE_DELAY": "0"}, {"FLASHCKPT_TEST_WRITE_DELAY": "4"})
    procs = launch_nodes(ckpt, out, "save:1:persist,wait,save:2:persist,mark:saved,wait,mark:done,await:never",
                         extra, slow)
    deadline = time.monotonic() + 120
    while not os.path.exists(out / "saved-1"):
        assert time.monotonic() < deadline and procs[1].poll() is None, "node 1 never saved step 2"
        time.sleep(0.05)
    node1 = records(out)[1]
    os.kill(node1["pid"], signal.SIGKILL)  # node 1 goes down: its rank,
    for pid in saver_pids(node1["run_dir"]):  # its saver, in the middle of writing step 2,
        os.kill(pid, signal.SIGKILL)
    os.killpg(procs[1].pid, signal.SIGKILL)  # and its agent
    deadline = time.monotonic() + 60
    while not os.path.exists(out / "done-0"):
        assert time.monotonic() < deadline, "rank 0 never learnt the outcome of step 2"
        time.sleep(0.1)
    os.kill(records(out)[0]["pid"], signal.SIGKILL)  # workers run in their own sessions
    os.killpg(procs[0].pid, signal.SIGKILL)
    for proc in procs:
        proc.wait(30)
    wait_step2 = [e for e in records(out)[0]["events"] if e.get("wait") == 2][0]
    assert wait_step2["committed"] is False and "ranks [1]" in wait_step2["error"]
    steps = ckpt / ".flashckpt" / "steps"
    assert os.path.exists(steps / "1" / "COMMITTED") and not os.path.exists(steps / "2" / "COMMITTED")
    assert os.path.exists(steps / "2" / "FAILED")
    assert (ckpt / "latest").read_text().strip() == "1"
    assert not glob.glob(str(ckpt / "step-2" / "rank-1.pt"))
