"""Several nodes simulated on loopback: one torchrun agent per node, each with its own node id and
shared-memory directory (and so its own saver); waiting on them, and killing one whole."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from flashckpt_integrations.core.replication import list_replicas
from tests.distributed.launch import env, free_port, torchrun_cmd
from tests.helpers import kill_savers


def launch_nodes(script_and_args: list[str], nprocs: tuple[int, ...], shm: list[str], out) -> list[subprocess.Popen]:
    """Start one agent per node (``nprocs[n]`` ranks on node ``n``, node id ``node<n>``, shared memory in
    ``shm[n]``), every rank running ``script_and_args``."""
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = []
    for node, nproc in enumerate(nprocs):
        cmd = torchrun_cmd(nproc, port, nnodes=len(nprocs), node_rank=node) + [str(a) for a in script_and_args]
        node_env = env(FLASHCKPT_NODE_ID=f"node{node}", FLASHCKPT_SHM_DIR=shm[node], FLASHCKPT_SAVER_KEEP_RUN_DIR="1")
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def wait_for(condition, what: str, procs, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"a node exited while waiting for {what}: {proc.communicate()[0][-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def holds(shm: str, job: str, node: int, *, own: bool = False) -> dict[int, set[int]]:
    """The steps of each rank that node ``node`` holds in its store: its peers' replicas, or
    (``own``) the kept copies of its own ranks."""
    found: dict[int, set[int]] = {}
    for replica in list_replicas(shm, job):
        if (replica.from_node == node) == own:
            found.setdefault(replica.rank, set()).add(replica.step)
    return found


def kill_node(node_ranks: list[dict], proc: subprocess.Popen) -> None:
    for rec in node_ranks:
        os.kill(rec["pid"], signal.SIGKILL)  # workers run in sessions of their own
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    kill_savers(node_ranks[0]["run_dir"])
