"""A rank's SIGTERM notice (``core/stop_notice.py``) belongs to the rank alone: a child forked
from it (a ``DataLoader`` worker, which its loader may terminate with SIGTERM) dies of SIGTERM as
it always did, and its signal never reaches the rank, which trains on. Real processes: a rank
with a ``Checkpointer`` and its saver, a child forked by multiprocessing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO, kill_savers

SCRIPT = r'''
import json, multiprocessing as mp, os, signal, sys, time
import torch
from flashckpt_integrations import Checkpointer

def child():
    time.sleep(60)

ck = Checkpointer(sys.argv[1])
print(json.dumps({"run_dir": ck.run_dir}), flush=True)
ck.save(1, {"w": torch.ones(4)}, persist=False)
ck.wait_for_snapshot()
worker = mp.get_context("fork").Process(target=child)
worker.start()
time.sleep(0.5)
os.kill(worker.pid, signal.SIGTERM)
worker.join(10)
print(json.dumps({"child": worker.exitcode}), flush=True)
time.sleep(3)  # the rank would have asked its saver to drain and ended itself by now
print(json.dumps({"alive": True, "steps_on_storage": ck.committed_steps()}), flush=True)
ck.close(wait=False)
'''


def test_a_forked_child_that_gets_sigterm_dies_of_it_and_the_rank_trains_on(tmp_path, private_shm_dir):
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=120)
    lines = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            lines.update(json.loads(line))
    try:
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
        assert lines.get("child") == -15, lines
        assert lines.get("alive") is True and lines.get("steps_on_storage") == [], (lines, proc.stderr[-3000:])
    finally:
        if "run_dir" in lines:
            kill_savers(lines["run_dir"])
