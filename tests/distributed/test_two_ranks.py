"""Two gloo ranks under torchrun: persist, commit, crash, restore from memory, reload from storage."""

import os

import pytest

from flashckpt_integrations.core.client import job_key
from tests.distributed.launch import records, run
from tests.helpers import marker_names

pytestmark = pytest.mark.distributed


def test_save_commit_crash_restore_from_memory_then_storage(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(ckpt, tmp_path / "run1", "save:1:persist,wait,save:2:memory,barrier,kill:0,await:never")
    assert first.returncode != 0  # rank 0 was killed
    assert sorted(os.listdir(ckpt / "step-1")) == ["rank-0.pt", "rank-1.pt"]
    assert (ckpt / "latest").read_text().strip() == "1"
    for rec in records(tmp_path / "run1"):
        assert rec["events"][1] == {"wait": 1, "committed": True, "error": None}

    second = run(ckpt, tmp_path / "run2", "load,save:3:persist,wait,close")
    assert second.returncode == 0, second.stderr[-3000:]
    for rec in records(tmp_path / "run2"):
        assert rec["events"][0] == {"load": 2, "source": "memory", "equal": True}, rec
        assert rec["events"][2]["committed"] is True

    # close() freed the memory: a new job instance reads the newest commit from storage
    third = run(ckpt, tmp_path / "run3", "load,close")
    assert third.returncode == 0, third.stderr[-3000:]
    for rec in records(tmp_path / "run3"):
        assert rec["events"][0] == {"load": 3, "source": "storage", "equal": True}, rec
    assert marker_names(ckpt / ".flashckpt" / "steps" / "3") == ["COMMITTED", "rank-0.done", "rank-1.done"]


def test_memory_is_used_only_when_every_rank_holds_the_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(ckpt, tmp_path / "run1", "save:1:persist,wait,save:2:memory,barrier,kill:0,await:never")
    assert first.returncode != 0
    # rank 1 loses its memory (say its node was replaced): nobody may load step 2
    prefix = f"flashckpt-{os.getuid()}-{job_key(str(ckpt))}-r1-"
    for k in (0, 1):
        os.unlink(os.path.join(os.environ["FLASHCKPT_SHM_DIR"], f"{prefix}{k}"))
    second = run(ckpt, tmp_path / "run2", "load,close")
    assert second.returncode == 0, second.stderr[-3000:]
    recs = records(tmp_path / "run2")
    assert recs[0]["events"][0]["load"] == 1 and recs[1]["events"][0]["load"] == 1
    assert recs[1]["events"][0]["source"] == "storage" and all(r["events"][0]["equal"] for r in recs)
