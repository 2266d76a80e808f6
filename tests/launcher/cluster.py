"""Four nodes simulated on loopback: four ``flashckpt-run`` launchers, one worker each, torch's c10d
rendezvous on 127.0.0.1, each launcher with its own node name (``FLASHCKPT_NODE_NAME``).

host-a hosts the rendezvous store (``is_host=1``; the others are clients), as the endpoint's own
node does in a cluster, so it must not be the node that leaves. The switches interleave with the
host names, so the switch order differs from both the name order and torch's own (start) order.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
from collections import defaultdict

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from tests.distributed.launch import REPO, free_port

WORKER = os.path.join(REPO, "tests", "launcher", "cluster_worker.py")
SWITCH_LABEL = "example.com/switch"
SWITCHES = {"host-a": "rack-2", "host-b": "rack-1", "host-c": "rack-2", "host-d": "rack-1"}
HOSTS = sorted(SWITCHES)
RDZV_CONF = "last_call_timeout=5,join_timeout=120"


def switch_order(nodes) -> list[str]:
    """The node order the topology handler must produce: by switch, then by node name."""
    return sorted(nodes, key=lambda n: (SWITCHES[n], n))


def launch(out, options, worker_args=(), **env) -> dict[str, subprocess.Popen]:
    os.makedirs(out, exist_ok=True)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    procs = {}
    for host in HOSTS:
        cmd = [sys.executable, "-m", "flashckpt_integrations.launcher.run", "--nnodes", "3:4", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cluster-test",
               "--rdzv-conf", f"is_host={int(host == 'host-a')},{RDZV_CONF}", "--max-restarts", "3",
               "--monitor-interval", "0.1", *options, WORKER, "--out", str(out), *worker_args]
        procs[host] = subprocess.Popen(cmd, env={**base, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1",
                                                 "PYTHONUNBUFFERED": "1", "FLASHCKPT_NODE_NAME": host, **env},
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True, cwd=REPO)
    return procs


def finish(procs, timeout=150) -> dict[str, tuple[int, str]]:
    results = {}
    for host, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            rest = {h: p.communicate()[0][-3000:] for h, p in procs.items() if h != host and p.returncode is None}
            pytest.fail(f"the launcher of {host} did not finish within {timeout}s:\n{output[-5000:]}\n{rest}")
        results[host] = (proc.returncode, output)
    return results


def run(out, options, worker_args=(), **env) -> tuple[dict[str, tuple[int, str]], dict[str, int], dict[str, str]]:
    """Launch the four nodes, wait for them, reap what they left; return each node's (exit code,
    output), the exit codes, and the tails of the outputs (for assertion messages)."""
    procs = launch(out, options, worker_args, **env)
    try:
        results = finish(procs)
    finally:
        reap(out)
    codes = {host: rc for host, (rc, _) in results.items()}
    tails = {host: output[-3000:] for host, (_, output) in results.items()}
    return results, codes, tails


def rounds(out) -> list[list[dict]]:
    """The workers' records, one list per rendezvous round (in the order the rounds ran)."""
    by_round: dict[str, list[dict]] = defaultdict(list)
    with open(os.path.join(out, "records.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            by_round[record["round"]].append(record)
    return list(by_round.values())


def assert_ranks_follow_switches(out) -> list[list[str]]:
    """Every round's ranks follow the switch order of its nodes; returns each round's node order."""
    orders = []
    for records in rounds(out):
        nodes = [r["node"] for r in records]
        assert len(records) == records[0]["world"] and len(set(nodes)) == len(nodes), records
        by_rank = [r["node"] for r in sorted(records, key=lambda r: r["rank"])]
        assert by_rank == switch_order(nodes), records
        assert all(r["group_rank"] == r["rank"] for r in records), records  # one worker per node
        orders.append(by_rank)
    return orders


def reap(out) -> None:
    """Kill (by pid) what a test left running: workers live in their own sessions."""
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                mentions = str(out).encode() in f.read()
            pid = int(path.split("/")[2])
            if mentions and pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            continue


def rendezvous_in_threads(backend: str, nodes: dict[str, str | None], run_id: str,
                          shutdown: bool = True) -> dict[str, tuple[int, object]]:
    """One round of ``backend`` among ``nodes`` (name -> switch), one thread each, in this process:
    each node's rank and rendezvous handler."""
    port = free_port()
    handlers = {}
    for i, (name, switch) in enumerate(nodes.items()):
        conf = {"is_host": i == 0, "last_call_timeout": 1, "node_name": name}
        if switch is not None:
            conf["switch"] = switch
        params = RendezvousParameters(backend=backend, endpoint=f"127.0.0.1:{port}", run_id=run_id,
                                      min_nodes=len(nodes), max_nodes=len(nodes), **conf)
        handlers[name] = rdzv_registry.get_rendezvous_handler(params)
    ranks: dict[str, tuple[int, object]] = {}

    def join(name: str) -> None:
        ranks[name] = (handlers[name].next_rendezvous().rank, handlers[name])

    threads = [threading.Thread(target=join, args=(name,)) for name in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(ranks) == len(nodes), ranks
    for handler in handlers.values() if shutdown else ():
        handler.shutdown()
    return ranks
