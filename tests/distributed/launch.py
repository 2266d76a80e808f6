"""Launch ``worker.py`` under torchrun for the multi-process tests."""

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, port: int, *, nnodes: int = 1, node_rank: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}"]


def worker(ckpt, out, actions, *extra: str) -> list[str]:
    return [os.path.join(HERE, "worker.py"), "--ckpt", str(ckpt), "--out", str(out), "--actions", actions, *extra]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **extra}


def run(ckpt, out, actions, *extra: str, nproc: int = 2, timeout: float = 180) -> subprocess.CompletedProcess:
    os.makedirs(out, exist_ok=True)
    cmd = torchrun_cmd(nproc, free_port()) + worker(ckpt, out, actions, *extra)
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)


def records(out, world: int = 2) -> list[dict]:
    result = []
    for rank in range(world):
        with open(os.path.join(out, f"rank-{rank}.json")) as f:
            result.append(json.load(f))
    return result
