"""What a save's result says after the fact."""

import os
import time

import torch

from flashckpt_integrations import RetentionPolicy


def test_a_step_that_retention_deleted_after_newer_commits_still_reads_committed(make_checkpointer, tmp_path):
    ck = make_checkpointer(retention=RetentionPolicy(keep_last=1), commit_timeout_s=5)
    first = ck.save(1, {"w": torch.ones(4)})
    assert ck.save(2, {"w": torch.zeros(4)}).wait(60).committed
    deadline = time.monotonic() + 30  # retention runs once step 2's commit is answered
    while ck.committed_steps() != [2] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ck.committed_steps() == [2]  # step 1 is gone
    outcome = first.wait(10)  # answered from storage at once, not after the commit timeout
    assert outcome.committed and outcome.error is None
    ck.wait()
    assert not os.path.exists(tmp_path / "ckpt" / ".flashckpt" / "steps" / "1"), "no record of step 1 may come back"
