"""DeepSpeed's checkpoints through the flash engine: ZeRO 0-3 on two gloo ranks (DS_ACCELERATOR=cpu)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

from tests.deepspeed.launch import files_under, records, run_worker  # noqa: E402
from tests.distributed.launch import REPO  # noqa: E402
from tests.helpers import save_lines  # noqa: E402

pytestmark = pytest.mark.distributed

STAGES = ("0", "1", "2", "3")


def test_zero_stages_save_kill_and_resume(tmp_path):
    """Save step 2 (persisted) and 3 (memory only), kill -9, resume: from memory, with stock DeepSpeed
    from the saver's files, from storage, and through zero_to_fp32; all equal to the uninterrupted run."""
    ckpt, stock = tmp_path / "ckpt", tmp_path / "stock"
    first = run_worker("train", ckpt, tmp_path / "run1", "--stock", str(stock), "--kill")
    assert first.returncode != 0, first.stderr[-3000:]  # killed: nothing was closed
    for rec in records(tmp_path / "run1"):
        for stage in STAGES:
            assert rec[stage] == {"first": [2, "persisting"], "second": [3, "in_memory"], "committed": [2, True]}

    for stage in STAGES:
        ours, theirs = files_under(ckpt / f"stage{stage}"), files_under(stock / f"stage{stage}")
        assert sorted(ours) == sorted(theirs), stage  # DeepSpeed's own layout, file for file
        assert ours["latest"] == theirs["latest"] == b"global_step2"
        for name in ("zero_to_fp32.py", "zero_to_torch.py"):
            assert ours.get(name) == theirs.get(name)
        assert not (ckpt / f"stage{stage}" / "global_step3").exists()  # memory only

    second = run_worker("resume", ckpt, tmp_path / "run2", "--ref", str(tmp_path / "run1"))
    assert second.returncode == 0, second.stderr[-5000:]
    for rank, rec in enumerate(records(tmp_path / "run2")):
        for stage in STAGES:
            got = rec[stage]
            assert got["memory"] == [3, "memory", 3], (rank, stage, got)
            assert got["stock"][1] == 2 and got["storage"] == [2, "storage", 2], (rank, stage, got)
            assert got["memory_equal"] and got["stock_equal"] and got["storage_equal"], (rank, stage, got)
            if rank == 0 and stage != "0":
                assert got["zero_to_fp32_equal"], (stage, got)


def test_async_snapshot_and_bad_input(tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run_worker("bad", ckpt, tmp_path / "out", stages="1")
    assert result.returncode == 0, result.stderr[-5000:]
    recs = records(tmp_path / "out")
    for rank, rec in enumerate(recs):
        assert rec["async"] == ["persisting", True, [2, "storage"], True], rec["async"]
        # one INFO line for the one save that happened: the step's real folder, the whole call's stall
        lines = save_lines(rec["logs"], "DeepSpeed save_checkpoint")
        assert [line[:4] for line in lines] == [(rank, 2, "persisting", f"to {ckpt}/stage1-async/global_step2")], rec
        assert lines[0][4] + 0.0005 >= rec["blocking_s"]["2"], (lines, rec["blocking_s"])
        assert not [m for m in rec["logs"] if "flashckpt-files" in m], rec["logs"]
        assert "'best' does not name a training step" in rec["tag"] and "global_step" in rec["tag"]
        assert rec["memory_steps"] == []
    assert "flashckpt-files" not in result.stdout + result.stderr
    assert "was not called by every one of the 2 ranks" in recs[0]["one_rank"]
    assert "Nothing of this step was saved" in recs[0]["one_rank"]
    stage_dir = ckpt / "stage1"
    assert not stage_dir.exists() or not [p for p in stage_dir.rglob("*") if p.is_file()]  # no partial checkpoint


def test_missing_deepspeed_names_the_extra():
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "try:\n    import flashckpt_integrations.adapters.deepspeed\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                         "PYTHONPATH": REPO}, timeout=120)
    assert "MissingDependencyError" in out.stdout and "flashckpt-integrations[deepspeed]" in out.stdout, out
