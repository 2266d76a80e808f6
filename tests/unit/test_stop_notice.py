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


def _run(script: str, ckpt: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``script`` on ``ckpt`` in a fresh interpreter (no ``LOCAL_WORLD_SIZE``); its JSON lines, merged."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-c", script, ckpt], env=env, capture_output=True, text=True, timeout=120)
    lines: dict = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            lines.update(json.loads(line))
    return proc, lines


def test_a_forked_child_that_gets_sigterm_dies_of_it_and_the_rank_trains_on(tmp_path, private_shm_dir):
    proc, lines = _run(SCRIPT, str(tmp_path / "ckpt"))
    try:
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
        assert lines.get("child") == -15, lines
        assert lines.get("alive") is True and lines.get("steps_on_storage") == [], (lines, proc.stderr[-3000:])
    finally:
        if "run_dir" in lines:
            kill_savers(lines["run_dir"])


NOTICES = r'''
import json, os, sys, time
import torch
from flashckpt_integrations import Checkpointer
from flashckpt_integrations.core.stop_notice import ask_saver

ck = Checkpointer(sys.argv[1])
print(json.dumps({"run_dir": ck.run_dir}), flush=True)
assert ck.save(1, {"w": torch.ones(4)}).wait(60).committed  # the saver is up and this rank connected
ck.save(3, {"w": torch.full((4,), 3.0)}, persist=False)
ck.wait_for_snapshot()
os.environ["LOCAL_WORLD_SIZE"] = "2"  # the node runs two ranks; the other one sends no notice
started = time.monotonic()
lone = ask_saver(ck.run_dir, 0, time.monotonic() + 20)
print(json.dumps({"lone": lone, "took": time.monotonic() - started, "after_lone": ck.committed_steps()}), flush=True)
time.sleep(2)  # a later stop, apart from the first
os.environ["LOCAL_WORLD_SIZE"] = "1"  # every rank of the node sends one: a preemption
whole = ask_saver(ck.run_dir, 0, time.monotonic() + 20)
print(json.dumps({"whole": whole, "after_whole": ck.committed_steps()}), flush=True)
ck.close(wait=False)
'''


def test_a_notice_that_the_nodes_other_ranks_do_not_send_follows_a_failure_and_drains_nothing(tmp_path,
                                                                                               private_shm_dir):
    """A rank killed before it ever connected to its saver leaves no disconnection to tell a crash
    by: the launcher's SIGTERM to the surviving rank then looks like a preemption. The notice says
    how many ranks the node runs; one that comes alone is a failure (answered, nothing drained),
    and notices from every rank are a preemption (the memory-only step is committed)."""
    proc, lines = _run(NOTICES, str(tmp_path / "ckpt"))
    try:
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
        assert lines["lone"].get("drained") is False and "sent no notice" in lines["lone"]["reason"], lines
        assert lines["after_lone"] == [1], lines
        assert lines["whole"].get("drained") is True, lines
        assert lines["after_whole"] == [1, 3], lines
    finally:
        if "run_dir" in lines:
            kill_savers(lines["run_dir"])
