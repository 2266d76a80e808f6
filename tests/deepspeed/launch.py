"""Run ``ds_worker.py`` (or another script) under torchrun with DeepSpeed on CPU."""

from __future__ import annotations

import json
import os
import subprocess

from tests.distributed.launch import env, free_port, torchrun_cmd

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ds_worker.py")


def ds_env(**extra: str) -> dict[str, str]:
    return env(DS_ACCELERATOR="cpu", **extra)


def run_worker(phase: str, ckpt, out, *extra: str, stages: str = "0,1,2,3", timeout: float = 300):
    os.makedirs(out, exist_ok=True)
    cmd = torchrun_cmd(2, free_port()) + [WORKER, "--phase", phase, "--ckpt", str(ckpt), "--out", str(out),
                                          "--stages", stages, *extra]
    return subprocess.run(cmd, env=ds_env(), capture_output=True, text=True, timeout=timeout)


def records(out, world: int = 2) -> list[dict]:
    result = []
    for rank in range(world):
        with open(os.path.join(out, f"rank-{rank}.json")) as f:
            rec = json.load(f)
        assert "error" not in rec, f"rank {rank}: {rec['error']}"
        result.append(rec)
    return result


def files_under(root) -> dict[str, bytes]:
    """Every file under ``root`` except our own metadata, by relative path."""
    out = {}
    for base, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".flashckpt"]
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out
