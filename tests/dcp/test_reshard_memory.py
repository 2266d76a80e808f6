"""Resume on another number of ranks from memory: FSDP2 state saved by 4 ranks restored onto 2, and by 2
onto 4, from the old ranks' slots on this node (the step is only in memory), equal to what was saved."""

import json

import pytest
import torch

from tests.dcp.launch import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _full(path):
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4)])
def test_fsdp2_state_restores_onto_another_number_of_ranks_from_memory(tmp_path, before, after):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", first, "--steps", 4, "--persist-at", 2,
                   "--memory-at", 4, "--dump-at", 4, "--kill-at", 4, nproc=before)
    assert run.returncode != 0 and (first / "full-4.pt").exists(), run.stderr[-3000:]
    run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", second, "--steps", 4, "--resume", "--dump-at", 4,
                   nproc=after)
    assert run.returncode == 0, run.stderr[-5000:]
    for rank in range(after):
        events = json.loads((second / f"rank-{rank}.json").read_text())["events"]
        assert events[0] == {"load": 4, "source": "memory"}, events
    saved, restored = _full(first / "full-4.pt"), _full(second / "full-4.pt")
    assert saved.keys() == restored.keys()
    assert [k for k in saved if not torch.equal(saved[k], restored[k])] == []
