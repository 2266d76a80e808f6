"""A lost node's ranks resume from a peer's memory: two nodes simulated on loopback (two torchrun
agents with their own node id, shared-memory directory and saver; one rank on node 0, two on node
1), memory snapshots every step, a persist every 5. Node 1 is killed whole (ranks, saver, agent)
and its shared memory deleted, node 0's processes are killed too, the committed step directories
are moved away; the relaunched job resumes every rank from memory at the newest step (node 1's
ranks from node 0's replicas) and ends with the parameters of an uninterrupted run, bit for bit:
through ``Checkpointer.load`` and through an adapter's resume (the DCP adapter's ``load``, which
decides the step itself, as every adapter does). Before the relaunch, with the engine API, node 0
alone persists and commits the paused step (``flashckpt persist --from-replicas``: node 1's ranks
from the replicas node 0 holds), and torch's own loader reads every rank's file. The ranks are
data-parallel replicas of one another: with the engine API (a 1 MB state), what node 1's saver
sends node 0 for each rank is under 1% of the snapshot, the rest copied from node 0's own rank."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import pytest
import torch

from flashckpt_integrations import cli
from flashckpt_integrations.core.client import job_key, private_dir, run_dir_for
from flashckpt_integrations.core.replication import STATUS_FILE
from flashckpt_integrations.core.shm_buffer import Slot, SlotState
from tests.distributed.launch import HERE, env, free_port, torchrun_cmd
from tests.distributed.nodes import holds, kill_node, wait_for
from tests.distributed.replica_worker import reference
from tests.helpers import complete_slots, flip_slot_byte, kill_savers, saver_pids

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

NPROC = (1, 2)
WORLD = sum(NPROC)
STEPS, PAUSE = 20, 12
WIDE = 4096


def launch(ckpt, out, shm, *extra: str) -> list[subprocess.Popen]:
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = []
    for node, nproc in enumerate(NPROC):
        cmd = torchrun_cmd(nproc, port, nnodes=2, node_rank=node) + [
            os.path.join(HERE, "replica_worker.py"), "--ckpt", str(ckpt), "--out", str(out), "--steps", str(STEPS),
            *extra]
        node_env = env(FLASHCKPT_NODE_ID=f"node{node}", FLASHCKPT_SHM_DIR=shm[node], FLASHCKPT_SAVER_KEEP_RUN_DIR="1")
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def ranks(out) -> list[dict]:
    result = []
    for rank in range(WORLD):
        with open(os.path.join(out, f"rank-{rank}.json")) as f:
            result.append(json.load(f))
    return result


def local_steps(shm: str, job: str, rank: int) -> set[int]:
    """The steps in rank ``rank``'s own slots."""
    steps = set()
    for path in glob.glob(os.path.join(shm, f"flashckpt-{os.getuid()}-{job}-r{rank}-*")):
        slot = Slot.attach(path)
        header = slot.read_header() if slot is not None else None
        if header is not None and header.state is SlotState.COMPLETE:
            steps.add(header.step)
        if slot is not None:
            slot.close()
    return steps


def assert_like_uninterrupted(out, steps: int, world: int, width: int = 32) -> None:
    """Every rank's final parameters (``final-<rank>.pt`` in ``out``) are those of a run that was
    never interrupted, bit for bit."""
    expected = reference(steps, world, width)
    for rank in range(world):
        final = torch.load(os.path.join(out, f"final-{rank}.pt"))
        for name, value in expected.items():
            assert torch.equal(final[name], value), f"rank {rank} {name} differs from the uninterrupted run"


def sent_to(run_dir: str, rank: int, node: int) -> dict:
    """The outcome of the newest copy of ``rank`` to ``node``, from its saver's status file."""
    try:
        with open(os.path.join(run_dir, STATUS_FILE)) as f:
            return json.load(f)["sent"].get(str(rank), {}).get(str(node), {})
    except (OSError, ValueError, KeyError):
        return {}


@pytest.mark.parametrize("api", ["core", "dcp", "bad-local"])
def test_a_replaced_node_resumes_from_its_peers_memory(tmp_path, private_shm_dir, capsys, api):
    """``bad-local``: node 1 comes back with its memory, but a stray write hit every one of its ranks'
    snapshots: those ranks restore from node 0's replicas instead (verified), node 0's from its own."""
    bad_local, api = api == "bad-local", "core" if api == "bad-local" else api
    ckpt, job = tmp_path / "ckpt", job_key(str(tmp_path / "ckpt"))
    shm = [private_dir(os.path.join(private_shm_dir, f"node{n}")) for n in (0, 1)]
    run_dirs = [run_dir_for(job, job_key(f"node{n}")[:8]) for n in (0, 1)]
    try:
        width = ["--width", str(WIDE)] if api == "core" else []  # a state of 1 MB: the reuse shows
        first = launch(ckpt, tmp_path / "run1", shm, "--pause-at", str(PAUSE), "--api", api, *width)
        wait_for(lambda: all(os.path.exists(tmp_path / "run1" / f"paused-{r}") for r in range(WORLD)), "step 12",
                 first)
        wait_for(lambda: holds(shm[0], job, 0).get(1, set()) >= {PAUSE} and holds(shm[0], job, 0).get(2, set())
                 >= {PAUSE} and PAUSE in holds(shm[1], job, 1).get(0, set()), "the replicas of step 12", first)
        assert set(holds(shm[0], job, 0)) == {1, 2}, "node 0 holds node 1's ranks"
        assert set(holds(shm[1], job, 1)) == {0}, "node 1 holds node 0's rank"
        assert PAUSE in holds(shm[0], job, 0, own=True)[0], "node 0 keeps its own rank's copy of the round"
        if api == "core":  # data-parallel ranks: node 0's own rank holds the same tensors, only the rest travels
            copies = []
            for rank in (1, 2):
                wait_for(lambda r=rank: sent_to(run_dirs[1], r, 0).get("step") == PAUSE, "the copy's report", first)
                copies.append(sent_to(run_dirs[1], rank, 0))
                assert copies[-1]["ok"], copies[-1]
            # (one rank's copy may go whole: a comparison that found nothing to reuse earlier in the run
            # makes the next copies of that rank skip comparing, see replication.reuse.LocalCrcs)
            assert any(copy["sent"] < copy["bytes"] / 100 for copy in copies), copies

        capsys.readouterr()
        assert cli.main(["ls", str(ckpt), "--shm-dir", shm[0]]) == 0
        listing = capsys.readouterr().out
        assert "node 0" in listing and "node 1" in listing, listing
        assert re.search(rf"replica rank    1  steps (\d+, )?{PAUSE}  \(from node 1\)", listing), listing
        assert re.search(rf"local   rank    0  steps (\d+, )?{PAUSE}\n", listing), listing

        recs = ranks(tmp_path / "run1")
        kill_node([recs[1], recs[2]], first[1])  # node 1 goes down whole,
        if bad_local:  # its memory survives, every snapshot of its ranks with a flipped byte
            for _, _, path in complete_slots(shm[1]):
                flip_slot_byte(path)
        else:
            shutil.rmtree(shm[1])  # and its replacement has none of its memory
        kill_node([recs[0]], first[0])  # the job restarts: node 0's processes go too (its memory stays)
        for run_dir in run_dirs:
            assert not saver_pids(run_dir)
        private_dir(shm[1])
        if api == "core":  # node 0 alone persists and commits step 12: node 1's ranks from its replicas
            capsys.readouterr()
            assert cli.main(["persist", str(ckpt), "--shm-dir", shm[0], "--from-replicas"]) == 0
            said = capsys.readouterr().out
            assert f"step {PAUSE} is committed (ranks [0, 1, 2]" in said, said
            at_pause = reference(PAUSE, WORLD, WIDE)
            for rank in range(WORLD):  # torch's own loader reads every rank's file
                saved = torch.load(ckpt / f"step-{PAUSE}" / f"rank-{rank}.pt", weights_only=True)
                assert saved["step"] == PAUSE
                for name, value in at_pause.items():
                    assert torch.equal(saved["model"][name], value), f"rank {rank} {name}"
            os.rename(ckpt / f"step-{PAUSE}", tmp_path / f"moved-step-{PAUSE}")
        for step in (5, 10):  # were storage read, the relaunch would fail
            os.rename(ckpt / f"step-{step}", tmp_path / f"moved-step-{step}")

        second = launch(ckpt, tmp_path / "run2", shm, "--api", api, *width)  # the DCP adapter's resume: replicas too
        outputs = []
        for node, proc in enumerate(second):
            output, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"node {node}:\n{output[-4000:]}"
            outputs.append(output)
        recs = ranks(tmp_path / "run2")
        for rec in recs:
            assert rec["load"]["step"] == PAUSE and rec["load"]["source"] == "memory", rec["load"]
            assert rec["committed"] is True
        assert recs[0]["load"]["fetched"] is None, "node 0's rank restores from its own memory"
        for rec in recs[1:]:
            assert rec["load"]["fetched"]["from_node"] == 0, rec["load"]
        if bad_local:
            assert [rec["load"]["tiers"] for rec in recs] == [{"0": "memory", "1": "replica", "2": "replica"}] * 3
            assert "failed verification" in outputs[1]
        assert_like_uninterrupted(tmp_path / "run2", STEPS, WORLD, WIDE if api == "core" else 32)
        assert (ckpt / "latest").read_text().strip() == str(STEPS)
        wait_for(lambda: not any(saver_pids(d) for d in run_dirs), "the savers to exit after the job", [])
        assert os.listdir(shm[0]) == [] and os.listdir(shm[1]) == [], "a clean end removes slots and replicas"
    finally:
        for run_dir in run_dirs:
            kill_savers(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)


def test_a_node_lost_while_training_resumes_from_the_step_kept_in_every_node(tmp_path, private_shm_dir):
    """No pause: the job trains on, a snapshot every step (each a little longer than a loopback
    copy) and no commit, while the replication rounds keep one step on every node. Node 1 is
    lost mid-training: the relaunched job resumes every rank from memory at the newest step that
    node 0 holds for every rank (its own rank: in its slots or its kept copy; node 1's ranks: in
    its replicas), node 1's ranks from node 0, and ends with an uninterrupted run's parameters."""
    ckpt, job = tmp_path / "ckpt", job_key(str(tmp_path / "ckpt"))
    shm = [private_dir(os.path.join(private_shm_dir, f"node{n}")) for n in (0, 1)]
    run_dirs = [run_dir_for(job, job_key(f"node{n}")[:8]) for n in (0, 1)]
    steps = 400

    def common() -> set[int]:
        replicas, own = holds(shm[0], job, 0), holds(shm[0], job, 0, own=True)
        mine = own.get(0, set()) | local_steps(shm[0], job, 0)
        return mine & replicas.get(1, set()) & replicas.get(2, set())

    try:
        args = ["--steps", str(steps), "--persist-every", "100000", "--step-sleep", "0.02"]
        first = launch(ckpt, tmp_path / "run1", shm, *args)
        wait_for(lambda: max(common(), default=0) >= 30, "a step kept on every node", first)
        recs = ranks(tmp_path / "run1")
        kill_node([recs[1], recs[2]], first[1])  # node 1 goes down whole while it trains,
        shutil.rmtree(shm[1])  # and its replacement has none of its memory
        kill_node([recs[0]], first[0])  # the job restarts: node 0's processes go too (its memory stays)
        private_dir(shm[1])
        expected, newest = max(common()), max(local_steps(shm[0], job, 0))
        assert expected < steps, "the job ended before the kill"

        second = launch(ckpt, tmp_path / "run2", shm, *args)
        for node, proc in enumerate(second):
            output, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"node {node}:\n{output[-4000:]}"
        recs = ranks(tmp_path / "run2")
        for rec in recs:  # (node 0's newest snapshot at the kill was step {newest})
            assert rec["load"]["step"] == expected and rec["load"]["source"] == "memory", (rec["load"], newest)
        for rec in recs[1:]:
            assert rec["load"]["fetched"]["from_node"] == 0, rec["load"]
        assert_like_uninterrupted(tmp_path / "run2", steps, WORLD)
    finally:
        for run_dir in run_dirs:
            kill_savers(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
