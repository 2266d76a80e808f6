"""Resume on another number of ranks from memory (FSDP2 + AdamW through the DCP adapter).

A lost node with no spare: 4 ranks on 2 simulated nodes (2 ranks each, own shared memory and
saver, one peer replica), a snapshot every step and a persist every 5. Node 1 dies whole and its
memory is gone; the job comes back on node 0 alone with 2 ranks and restores the newest step from
memory (node 0's slots and its replicas of node 1's ranks), reading nothing from storage. What it
restores (model and optimizer) equals the saved state and a resharding ``dcp.load`` of the same
step from storage onto 2 ranks, and training goes on exactly as a run resumed from storage.
And the other way: 2 ranks scaled up to 4 on one node, from memory only."""

import json
import os
import shutil

import pytest
import torch

from flashckpt_integrations import cli
from flashckpt_integrations.core.client import job_key, private_dir, run_dir_for
from tests.dcp.launch import HERE, torchrun
from tests.distributed.launch import records
from tests.distributed.launch import run as run_worker
from tests.distributed.nodes import holds, kill_node, launch_nodes, wait_for
from tests.helpers import assert_same, complete_slots, flip_slot_byte, kill_savers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

COUNTING = ("--storage-factory", "tests.helpers:CountingStorage")


def _full(path):
    return torch.load(path, weights_only=True)


def _loads(out, world: int) -> list[dict]:
    return [json.loads((out / f"rank-{rank}.json").read_text())["events"][0] for rank in range(world)]


def test_a_lost_node_resumes_on_the_node_left_from_memory(tmp_path, private_shm_dir, capsys):
    pause, steps = 7, 10
    ckpt, job = tmp_path / "ckpt", job_key(str(tmp_path / "ckpt"))
    shm = [private_dir(os.path.join(private_shm_dir, f"node{n}")) for n in (0, 1)]
    run_dirs = [run_dir_for(job, job_key(f"node{n}")[:8]) for n in (0, 1)]
    first, memory, storage = tmp_path / "first", tmp_path / "memory", tmp_path / "storage"
    try:
        nodes = launch_nodes([os.path.join(HERE, "fsdp_train.py"), "--ckpt", ckpt, "--out", first, "--steps", steps,
                              "--snapshot-every", 1, "--persist-every", 5, "--replicas", 1, "--pause-at", pause,
                              "--dump-at", pause], (2, 2), shm, first)
        wait_for(lambda: all((first / f"paused-{r}").exists() for r in range(4)), f"step {pause}", nodes, 300)
        wait_for(lambda: all(pause in holds(shm[0], job, 0).get(r, set()) for r in (2, 3)),
                 "node 0's replicas of node 1's ranks", nodes)
        recs = records(first, 4)
        kill_node(recs[2:], nodes[1])  # node 1 goes down whole, its memory with it,
        shutil.rmtree(shm[1])
        kill_node(recs[:2], nodes[0])  # and the job restarts on node 0 alone (its memory stays)

        # node 0 alone commits the paused step of all 4 old ranks (node 1's from its replicas): the reference
        capsys.readouterr()
        assert cli.main(["persist", str(ckpt), "--shm-dir", shm[0], "--from-replicas"]) == 0
        assert f"step {pause} is committed (ranks [0, 1, 2, 3]" in capsys.readouterr().out

        node0 = {"FLASHCKPT_NODE_ID": "node0", "FLASHCKPT_SHM_DIR": shm[0]}
        dumps = [str(s) for s in range(pause, steps + 1)]
        run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", memory, "--steps", steps, "--resume", *COUNTING,
                       "--dump-at", *dumps, nproc=2, **node0)
        assert run.returncode == 0, run.stderr[-5000:]
        assert "resharded step 7 from the memory of a job of 4 ranks onto 2 ranks" in run.stderr
        assert _loads(memory, 2) == [{"load": pause, "source": "memory", "storage_bytes": 0}] * 2
        assert records(memory, 2)[0]["lineage_commits"] == [5, pause], "the attempt continues the old job's lineage"

        run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", storage, "--steps", steps, "--resume", *COUNTING,
                       "--prefer-storage", "--dump-at", *dumps, nproc=2, **node0)
        assert run.returncode == 0, run.stderr[-5000:]
        for loaded in _loads(storage, 2):
            assert loaded["load"] == pause and loaded["source"] == "storage" and loaded["storage_bytes"] > 0, loaded

        assert_same(_full(memory / f"full-{pause}.pt"), _full(first / f"full-{pause}.pt"), "restored vs saved")
        for step in range(pause, steps + 1):  # the restore, then every step after it
            assert_same(_full(memory / f"full-{step}.pt"), _full(storage / f"full-{step}.pt"), f"step {step}")
    finally:
        for run_dir in run_dirs:
            kill_savers(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.parametrize("flipped", [False, True])
def test_fsdp2_state_restores_onto_more_ranks_from_memory(tmp_path, private_shm_dir, flipped):
    """2 ranks onto 4. ``flipped``: a byte of old rank 1's snapshot of step 4 flipped (a stray write): the
    4 ranks refuse it together and load the newest commit, step 2, from storage."""
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", first, "--steps", 4, "--persist-at", 2,
                   "--memory-at", 4, "--dump-at", 2, 4, "--kill-at", 4, nproc=2)
    assert run.returncode != 0 and (first / "full-4.pt").exists(), run.stderr[-3000:]
    if flipped:
        flip_slot_byte(next(path for rank, step, path in complete_slots(private_shm_dir) if (rank, step) == (1, 4)))
    run = torchrun("fsdp_train.py", "--ckpt", ckpt, "--out", second, "--steps", 4, "--resume", "--dump-at", 2, 4,
                   *COUNTING, nproc=4)
    assert run.returncode == 0, run.stderr[-5000:]
    if flipped:
        assert "the snapshot of old rank 1 (step 4)" in run.stderr and "did not verify" in run.stderr, run.stderr
        for loaded in _loads(second, 4):
            assert loaded["load"] == 2 and loaded["source"] == "storage" and loaded["storage_bytes"] > 0, loaded
        assert_same(_full(second / "full-2.pt"), _full(first / "full-2.pt"))
        return
    assert _loads(second, 4) == [{"load": 4, "source": "memory", "storage_bytes": 0}] * 4
    assert_same(_full(second / "full-4.pt"), _full(first / "full-4.pt"))


def test_engine_api_state_of_another_number_of_ranks_is_refused_by_name(tmp_path):
    """A state saved one file per rank (``Checkpointer.save``) cannot be spread over another number of
    ranks: the load says so and names the way out, rather than silently starting from an older commit."""
    ckpt = tmp_path / "ckpt"
    run = run_worker(ckpt, tmp_path / "first", "save:2:persist,wait,save:4:memory,barrier,kill:0,kill:1")
    assert run.returncode != 0 and (tmp_path / "first" / "rank-1.json").exists(), run.stderr[-3000:]
    run = run_worker(ckpt, tmp_path / "second", "load", nproc=1)
    assert run.returncode != 0
    assert "step 4 is in the memory of this job's nodes, saved by a job of 2 ranks; this job has 1" in run.stderr
    assert "flashckpt_integrations.adapters.dcp" in run.stderr, run.stderr[-3000:]
    assert "load(prefer_memory=False) loads the newest commit, step 2, instead" in run.stderr
