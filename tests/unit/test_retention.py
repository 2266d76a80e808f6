"""Retention keeps exactly the right steps, derived from storage, across saver restarts."""

import os

import pytest
import torch

from flashckpt_integrations import RetentionPolicy
from tests.helpers import kill_savers, saver_pids


@pytest.mark.parametrize(
    ("policy", "committed", "deleted"),
    [
        (RetentionPolicy(), [1, 2, 3], []),
        (RetentionPolicy(keep_last=2), [10, 20, 30, 40], [10, 20]),
        (RetentionPolicy(keep_last=1), [5], []),
        (RetentionPolicy(keep_every=100), [50, 100, 150, 200, 250], [50, 150]),
        (RetentionPolicy(keep_last=2, keep_every=100), [50, 100, 150, 200, 250, 300], [50, 150]),
        (RetentionPolicy(keep_last=3), [9, 10, 100], []),  # numeric order, not string order
        (RetentionPolicy(keep_last=1), [2, 10, 9], [2, 9]),
    ],
)
def test_policy_selection(policy, committed, deleted):
    assert policy.select_deletions(committed) == deleted


def test_policy_rejects_keeping_nothing():
    with pytest.raises(ValueError, match="newest committed checkpoint must be kept"):
        RetentionPolicy(keep_last=0)


def test_saver_applies_retention_after_commit_and_survives_a_restart(make_checkpointer, tmp_path):
    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt, retention=RetentionPolicy(keep_last=2, keep_every=4))
    for step in (1, 2, 3, 4, 5):
        assert ck.save(step, {"w": torch.full((8,), float(step))}).wait(60).committed
    _wait_for(lambda: ck.committed_steps() == [4, 5] and step_dirs(ckpt) == ["step-4", "step-5"])

    kill_savers(ck.run_dir)  # a new saver must decide from storage alone
    _wait_for(lambda: not saver_pids(ck.run_dir))
    for step in (6, 7, 8, 9):
        assert ck.save(step, {"w": torch.full((8,), float(step))}).wait(60).committed
    _wait_for(lambda: ck.committed_steps() == [4, 8, 9] and step_dirs(ckpt) == ["step-4", "step-8", "step-9"])
    assert (ckpt / "latest").read_text().strip() == "9"
    assert torch.equal(ck.load(4, prefer_memory=False).state["w"], torch.full((8,), 4.0))


def step_dirs(ckpt):
    return sorted(p for p in os.listdir(ckpt) if p.startswith("step-"))


def _wait_for(predicate, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def test_a_job_killed_while_retention_deletes_a_step_leaves_nothing_behind(make_checkpointer, tmp_path):
    # The saver is SIGKILLed (fault point retention.delete) after step 1 lost its commit record and
    # before its files went: the whole job is gone. The relaunched job's next commit finishes it.
    import textwrap

    from tests.helpers import run_python

    ckpt = tmp_path / "ckpt"
    child = textwrap.dedent(
        """
        import os, sys, torch
        from flashckpt_integrations import Checkpointer, RetentionPolicy
        ck = Checkpointer(sys.argv[1], retention=RetentionPolicy(keep_last=1))
        assert ck.save(1, {"w": torch.full((1000,), 1.0)}).wait(60).committed
        assert ck.save(2, {"w": torch.full((1000,), 2.0)}).wait(60).committed  # retention of step 1 kills the saver
        print(ck.run_dir, flush=True)
        os._exit(0)
        """
    )
    first = run_python(child, str(ckpt), env={"FLASHCKPT_FAULT": "retention.delete"})
    assert first.returncode == 0, first.stderr
    run_dir = first.stdout.strip()
    _wait_for(lambda: not saver_pids(run_dir))
    assert "fault injection: SIGKILL at retention.delete" in open(os.path.join(run_dir, "saver.log")).read()
    marker_dir = ckpt / ".flashckpt" / "steps" / "1"
    assert step_dirs(ckpt) == ["step-1", "step-2"] and (ckpt / "step-1" / "rank-0.pt").exists()
    assert marker_dir.is_dir() and not (marker_dir / "COMMITTED").exists()  # a leftover, not a commit

    ck = make_checkpointer(ckpt, retention=RetentionPolicy(keep_last=1))
    assert ck.committed_steps() == [2]
    assert ck.load().step == 2
    assert ck.save(3, {"w": torch.full((1000,), 3.0)}).wait(60).committed
    # retention removes step 2's files, then its markers: wait for both
    _wait_for(lambda: step_dirs(ckpt) == ["step-3"] and sorted(os.listdir(ckpt / ".flashckpt" / "steps")) == ["3"],
              timeout=15)
    assert not marker_dir.exists()
    assert ck.committed_steps() == [3]


def test_a_save_into_a_folder_of_its_own_is_committed_there_and_retention_deletes_that_folder(make_checkpointer,
                                                                                             tmp_path):
    """``save(step, folder=...)``: the step lands in the caller's folder (nested or not), loads from there,
    and retention deletes the folder its commit record names, not the layout's ``step-<N>``."""
    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt, retention=RetentionPolicy(keep_last=2))
    decoy = ckpt / "step-1"  # what the layout would name step 1: not this save's, never deleted
    decoy.mkdir(parents=True)
    (decoy / "keep.txt").write_text("mine")
    assert ck.save(1, {"w": torch.full((4,), 1.0)}, folder="runs/a/step_1").wait(60).committed
    assert (ckpt / "runs" / "a" / "step_1" / "rank-0.pt").exists()
    assert ck.save(2, {"w": torch.full((4,), 2.0)}, folder="epoch_1").wait(60).committed
    assert ck.save(3, {"w": torch.full((4,), 3.0)}).wait(60).committed  # the layout's own folder
    _wait_for(lambda: not (ckpt / "runs" / "a" / "step_1").exists(), timeout=15)
    assert ck.committed_steps() == [2, 3] and (decoy / "keep.txt").read_text() == "mine"
    assert torch.equal(torch.load(ckpt / "epoch_1" / "rank-0.pt", weights_only=True)["w"], torch.full((4,), 2.0))
    assert torch.equal(ck.load(2, prefer_memory=False).state["w"], torch.full((4,), 2.0))
    assert torch.equal(ck.load(3, prefer_memory=False).state["w"], torch.full((4,), 3.0))
    for bad in ("../elsewhere", "/abs/path", ".flashckpt/x", "a//b", ""):
        with pytest.raises(ValueError, match="must be a path relative to the checkpoint directory"):
            ck.save(4, {"w": torch.zeros(4)}, folder=bad)
    assert ck.committed_steps() == [2, 3]
