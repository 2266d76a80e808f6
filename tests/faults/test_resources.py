"""Running out of room: a full checkpoint file system, and a /dev/shm too small for the slots."""

from __future__ import annotations

import logging
import os

import torch

from flashckpt_integrations import Checkpointer, SaveStatus
from flashckpt_integrations.core.layout import failure_record
from flashckpt_integrations.core.storage import LocalStorage
from tests.faults import harness
from tests.faults.job import JobConfig, reference


def _state(seed: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 1024, generator=g), "step": seed}


def test_a_persist_that_does_not_fit_fails_clearly_and_the_last_commit_stays(small_tmpfs, caplog):
    ckpt = small_tmpfs("ckpt", "2m")
    caplog.set_level(logging.ERROR)
    with Checkpointer(ckpt) as ck:
        assert ck.save(1, _state(1, 64)).wait(60).committed  # 256 KiB fits

        too_big = ck.save(2, _state(2, 1024))  # 4 MiB does not
        outcome = too_big.wait(60)
        assert not outcome.committed
        assert "No space left on device" in outcome.error and "The storage is full" in outcome.error
        assert any("could not persist step 2" in r.message and "storage is full" in r.message
                   for r in caplog.records)
        assert failure_record(LocalStorage(str(ckpt)), 2) is not None
        assert ck.committed_steps() == [1]
        leftovers = os.listdir(ckpt / "step-2") if (ckpt / "step-2").exists() else []
        assert leftovers == [], f"the failed write left {leftovers} behind"

        previous = torch.load(ckpt / "step-1" / "rank-0.pt", weights_only=True)
        assert torch.equal(previous["w"], _state(1, 64)["w"])
        loaded = ck.load(1, prefer_memory=False)
        assert loaded.source == "storage" and torch.equal(loaded.state["w"], _state(1, 64)["w"])

        # the job goes on: the failed step is still in memory, and later saves commit
        assert ck.memory_steps() == [1, 2]
        assert ck.save(3, _state(3, 64)).wait(60).committed
        assert ck.committed_steps() == [1, 3]
        assert torch.equal(ck.load(prefer_memory=False).state["w"], _state(3, 64)["w"])


def test_shm_too_small_saves_straight_to_storage(small_tmpfs, monkeypatch, tmp_path, caplog):
    shm = small_tmpfs("shm", "512k", mode="1777")
    monkeypatch.setenv("FLASHCKPT_SHM_DIR", str(shm))
    caplog.set_level(logging.ERROR)
    small, big = _state(1, 16), _state(2, 256)  # 64 KiB fits in both slots; 1 MiB does not
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert ck.save(1, small).wait(60).committed  # through memory and the saver
        assert ck.memory_steps() == [1]

        result = ck.save(2, big)
        assert result.status is SaveStatus.PERSISTING and result.ok
        assert "written straight to storage" in result.reason
        assert "more bytes" in result.reason and "free" in result.reason and "--shm-size" in result.reason
        assert any("Writing step 2 straight to storage" in r.message for r in caplog.records)
        assert ck.committed_steps() == [1, 2]  # committed by the time save returned: rank 0 commits itself
        assert result.wait(30).committed
        native = torch.load(tmp_path / "ckpt" / "step-2" / "rank-0.pt", weights_only=True)
        assert torch.equal(native["w"], big["w"]) and native["step"] == 2

        memory_only = ck.save(3, _state(3, 256), persist=False)
        assert memory_only.status is SaveStatus.FAILED
        assert "memory-only save of step 3 was not kept" in memory_only.reason

        loaded = ck.load()
        assert (loaded.step, loaded.source) == (2, "storage") and torch.equal(loaded.state["w"], big["w"])
        assert ck.memory_steps() == [1]  # the failed growth left the slots usable
        assert ck.save(4, small, persist=False).status is SaveStatus.IN_MEMORY
        assert (ck.load().step, ck.load().source) == (4, "memory")


def test_two_ranks_with_too_little_shm_commit_every_persist_straight_to_storage(small_tmpfs, tmp_path, run_base):
    cfg = JobConfig()
    shm = small_tmpfs("shm", "4k", mode="1777")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    try:
        codes = harness.launch(cfg, ckpt, out, harness.job_env(run_base, FLASHCKPT_SHM_DIR=str(shm)))
        assert codes == [0, 0], open(os.path.join(out, "rank-0.log")).read()[-3000:]
        assert harness.check(ckpt, cfg, reference(cfg), out) == []
    finally:
        harness.stop_savers(run_base, ckpt)
    log = open(os.path.join(out, "rank-1.log")).read()
    assert "straight to storage" in log and "more bytes" in log
