"""FSDP2 sharded state through the flash DCP layer: 2 gloo ranks under torchrun."""

import os

import pytest
import torch

from flashckpt_integrations.core.client import job_key
from tests.dcp.launch import python, torchrun
from tests.distributed.launch import records
from tests.helpers import assert_same, complete_slots, flip_slot_byte

pytestmark = pytest.mark.distributed

STOCK_LOAD = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

torch.manual_seed(0)
layers = []
for i in range(3):
    layers += [nn.Linear(16 if i == 0 else 32, 32), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(32, 1))
state = {"model": model.state_dict()}
dcp.load(state, checkpoint_id=sys.argv[1])  # one process, no process group: the stock reader
assert "flashckpt_integrations" not in sys.modules
reference = torch.load(sys.argv[2])["model"]
assert list(state["model"]) == list(reference)
for key, value in reference.items():
    assert torch.equal(state["model"][key], value), key
metadata = dcp.FileSystemReader(sys.argv[1]).read_metadata()
print(sorted(k for k in metadata.state_dict_metadata if k.startswith("model.")))
"""


def _full(path):
    return torch.load(path, weights_only=True)


def test_fsdp2_memory_resume_storage_resume_and_stock_load(tmp_path):
    ckpt, ref, crash, resume, again = (tmp_path / n for n in ("ckpt", "ref", "crash", "resume", "again"))
    for d in (ref, crash, resume, again):
        d.mkdir()
    run = torchrun("fsdp_train.py", "--ckpt", tmp_path / "unused", "--out", ref, "--steps", 6, "--dump-at", 2, 4, 6)
    assert run.returncode == 0, run.stderr[-3000:]

    # persist step 2, snapshot step 4 in memory only, then every rank is killed
    run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", crash, "--steps", 6, "--persist-at", 2, "--memory-at", 4,
                   "--kill-at", 4)
    assert run.returncode != 0
    assert sorted(os.listdir(ckpt / "step-2")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "step-4").exists() and (ckpt / "latest").read_text().strip() == "2"

    # the restarted job resumes from memory (step 4, newer than the commit) and trains on
    run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", resume, "--steps", 6, "--resume", "--persist-at", 6,
                   "--dump-at", 6, "--checks")
    assert run.returncode == 0, run.stderr[-3000:]
    for rec in records(resume):
        assert rec["events"][0] == {"load": 4, "source": "memory"}
        assert rec["events"][1] == {"save": 6, "status": "persisting", "committed": True}
    assert_same(_full(resume / "full-6.pt"), _full(ref / "full-6.pt"))

    # bad input: a mismatched model names the keys; a call made by one rank fails fast
    checks = [rec["events"][2] for rec in records(resume)]
    for seen in checks:
        assert seen["mismatch"].startswith("LayoutMismatchError")
        for fragment in ("model.8.weight", "model.0.weight (checkpoint (32, 16), target (24, 16))", "ranks [0, 1]"):
            assert fragment in seen["mismatch"], seen["mismatch"]
    assert "ranks [1] did not call it" in checks[0]["save"] and "ranks [1] did not call it" in checks[0]["load"]
    assert "save" not in checks[1]

    # close() freed the memory: a new job loads the newest commit from storage, equal to the reference
    run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", again, "--steps", 6, "--resume", "--dump-at", 6)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [rec["events"][0] for rec in records(again)] == [{"load": 6, "source": "storage"}] * 2
    assert_same(_full(again / "full-6.pt"), _full(ref / "full-6.pt"))

    # a stray write in rank 1's snapshot of step 4: both ranks resume from the verified snapshot of step 2
    # (as new as the newest commit), never from the bad bytes, and train on to the same state
    flipped, crash2, resume2 = tmp_path / "ckpt2", tmp_path / "crash2", tmp_path / "resume2"
    for d in (crash2, resume2):
        d.mkdir()
    run = torchrun("fsdp_train.py", "--ckpt", flipped, "--out", crash2, "--steps", 6, "--persist-at", 2,
                   "--memory-at", 4, "--kill-at", 4)
    assert run.returncode != 0
    slots = {(rank, step): path for rank, step, path in complete_slots(os.environ["FLASHCKPT_SHM_DIR"])
             if path.endswith(("-0", "-1")) and job_key(str(flipped)) in path}
    flip_slot_byte(slots[1, 4])
    run = torchrun("fsdp_train.py", "--ckpt", flipped, "--out", resume2, "--steps", 6, "--resume", "--dump-at", 6)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [rec["events"][0] for rec in records(resume2)] == [{"load": 2, "source": "memory"}] * 2
    assert "the snapshot of step 4 in memory failed verification" in run.stderr
    assert_same(_full(resume2 / "full-6.pt"), _full(ref / "full-6.pt"))

    # stock torch.distributed.checkpoint.load, in a process that never imports this package
    for step in (2, 6):
        out = python(STOCK_LOAD, ckpt / f"step-{step}", ref / f"full-{step}.pt")
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == str(sorted(f"model.{k}" for k in _full(ref / "full-2.pt")["model"]))
