"""Verified restores on two gloo ranks: a bad copy in any tier is never handed to training; the
ranks fall back together to the newest step every one of them can serve verified."""

import os
import shutil

import pytest

from tests.distributed.launch import records, run
from tests.helpers import flip_file_byte, flip_slot_byte, rank_slots

pytestmark = pytest.mark.distributed

CRASHED = "save:1:persist,wait,save:2:memory,save:3:memory,barrier,kill:0,await:never"
"""Step 1 committed, steps 2 and 3 in memory only (one slot each), then rank 0 dies."""


def _vload(rec: dict) -> dict:
    return next(e for e in rec["events"] if "vload" in e)


def test_flipped_byte_in_one_ranks_newest_slot_falls_back_to_the_older_snapshot(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(ckpt, tmp_path / "run1", CRASHED)
    assert first.returncode != 0
    slots = rank_slots(ckpt, 1)
    assert sorted(slots) == [2, 3], slots
    flip_slot_byte(slots[3])

    second = run(ckpt, tmp_path / "run2", "vload,kill:0,await:never")
    for rec in records(tmp_path / "run2"):
        assert _vload(rec) == {"vload": 2, "source": "memory", "equal": True, "tiers": {"0": "memory", "1": "memory"},
                               "fallbacks": 1}, rec
    assert "step 3 from memory failed verification" in second.stderr
    assert "differ from the checksum taken when it was saved" in second.stderr

    # the bad copy was invalidated: the next restart takes step 2 at once, with no fallback
    assert sorted(rank_slots(ckpt, 1)) == [2]
    third = run(ckpt, tmp_path / "run3", "vload,close")
    assert third.returncode == 0, third.stderr[-3000:]
    for rec in records(tmp_path / "run3"):
        assert _vload(rec)["vload"] == 2 and _vload(rec)["equal"] and _vload(rec)["fallbacks"] == 0, rec


def test_every_memory_copy_of_a_rank_bad_falls_back_to_storage(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, tmp_path / "run1", CRASHED).returncode != 0
    slots = rank_slots(ckpt, 1)
    flip_slot_byte(slots[3])
    flip_slot_byte(slots[2], which="blob")  # the pickle, before anything is unpickled

    second = run(ckpt, tmp_path / "run2", "vload,close")
    assert second.returncode == 0, second.stderr[-3000:]
    for rec in records(tmp_path / "run2"):
        assert _vload(rec) == {"vload": 1, "source": "storage", "equal": True,
                               "tiers": {"0": "storage", "1": "storage"}, "fallbacks": 2}, rec


def test_a_flipped_or_truncated_storage_file_falls_back_to_the_older_commit_or_names_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(ckpt, tmp_path / "run1", "save:1:persist,wait,save:2:persist,wait,close")
    assert first.returncode == 0, first.stderr[-3000:]  # close() freed the memory: storage only
    flip_file_byte(ckpt / "step-2" / "rank-1.pt")
    second = run(ckpt, tmp_path / "run2", "vload,close")
    assert second.returncode == 0, second.stderr[-3000:]
    for rec in records(tmp_path / "run2"):
        assert _vload(rec)["vload"] == 1 and _vload(rec)["equal"] and _vload(rec)["source"] == "storage", rec
    assert "step-2/rank-1.pt" in second.stderr

    with open(ckpt / "step-1" / "rank-0.pt", "r+b") as f:  # the older one truncated too: nothing is left
        f.truncate(os.path.getsize(ckpt / "step-1" / "rank-0.pt") // 2)
    third = run(ckpt, tmp_path / "run3", "vload,close")
    assert third.returncode != 0
    assert "no older verified checkpoint is left" in third.stderr and "step-1/rank-0.pt" in third.stderr
    shutil.rmtree(ckpt)  # (the suite checks every torch file a test leaves behind)
