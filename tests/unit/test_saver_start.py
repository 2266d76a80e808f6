"""The saver starts without torch, and no save waits on its start-up.

The saver process imports neither torch nor numpy (it writes every format from the slot's
bytes), so it answers a fraction of a second after the first ``Checkpointer``. Saves taken before
it answers are held in their slots and persisted once it is up.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

import torch

from flashckpt_integrations import Checkpointer
from flashckpt_integrations.core.client import job_key, run_dir_for
from flashckpt_integrations.core.protocol import SPAWN_LOCK_NAME

HOLD_S = 5.0


def _state(step: int) -> dict[str, torch.Tensor]:
    # 256 MiB: large enough that a save's copy, not its fixed costs, is what a warm save takes
    return {"w": torch.full((64, 1 << 20), float(step)), "step": torch.tensor(step)}


def _mapped_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_saves_before_the_saver_is_up_do_not_wait_and_are_all_committed(tmp_path):
    url = str(tmp_path / "ckpt")
    states = {step: _state(step) for step in (1, 2, 3)}
    run_dir = run_dir_for(job_key(url), job_key("start-test")[:8])
    lock = os.open(os.path.join(run_dir, SPAWN_LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the saver cannot start until this is released: a slow start
    released = threading.Timer(HOLD_S, lambda: (fcntl.flock(lock, fcntl.LOCK_UN), os.close(lock)))
    started = time.monotonic()
    released.start()
    with Checkpointer(url, node_id="start-test") as ck:
        ck.prepare(_state(0))
        first = []
        for step in (1, 2, 3):  # two fill both slots, the third goes to the held slot: none waits
            first.append(ck.save(step, states[step]))
            time.sleep(0.1)  # as between training steps: the held slot is made meanwhile, off the path
        before_saver = time.monotonic() - started
        assert before_saver < HOLD_S, "the test machine is too slow to tell"
        assert not ck._client.connected
        held = ck._held_path
        assert os.path.exists(held)
        for result in first:
            assert result.ok and result.status.value == "persisting", result
        for result in first:
            assert result.wait(120).committed, result.wait(120)
        assert ck.committed_steps() == [1, 2, 3]
        warm = []
        for step in (4, 5, 6, 7, 8):  # memory-only saves once the saver is up: what a warm save costs
            warm.append(ck.save(step, _state(step), persist=False).blocking_s)
        warm_s = sorted(warm)[len(warm) // 2]
        blocked = [round(r.blocking_s / warm_s, 2) for r in first]
        assert max(blocked) <= 2.0, f"saves before the saver was up took {blocked} x a warm save ({warm_s:.4f} s)"
        assert not os.path.exists(held), "the held slot outlived the saver's start"
        assert sorted(ck.memory_steps()) == [7, 8]
        for step in (1, 2, 3):
            assert torch.equal(ck.load(step, prefer_memory=False).state["w"], states[step]["w"])
        pid = ck._client.saver_pid
        maps = _mapped_libraries(pid)
        assert "libtorch" not in maps and "numpy" not in maps, "the saver imported torch or numpy"
        assert held not in maps, "the saver kept the held slot mapped"
    released.join()
