"""The Megatron-LM patch resumes on fewer ranks from memory (``--ckpt-format torch_dist``).

A patched job of 4 ranks (data parallel 4, TP 1 / PP 1) saves iterations 1-3 (2 persisted, 3 in
memory only) and is SIGKILLed; relaunched with 2 ranks on the same node (data parallel 2), its
``load_checkpoint`` restores iteration 3 from the old ranks' memory, with the committed iteration
moved off storage. Real save_checkpoint / load_checkpoint on gloo, two launches shared by the tests
(see ``dist_worker.py``, modes ``reshard-crash`` and ``reshard-resume``), for a plain optimizer and
for the distributed optimizer (with ``--ckpt-fully-parallel-load``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("megatron.training.checkpointing")

from tests.megatron.test_megatron_torch_dist import launch, ok, records  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESHARDED = ["dp", "distopt"]
"""``torch_dist``, data parallel over every rank: plain optimizer; distributed optimizer."""
LAYOUTS = [*RESHARDED, "dp-torch"]
"""And ``--ckpt-format torch`` (plain optimizer), which is not resharded from memory."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4 ranks killed after a memory-only save -> (committed iteration moved away) 2 ranks resume."""
    base, out = tmp_path_factory.mktemp("mreshard"), tmp_path_factory.mktemp("mreshard-out")
    seen: dict = {}
    try:
        crashed = launch("reshard-crash", base, out, "--layouts", ",".join(LAYOUTS), nproc=4)
        assert crashed.returncode != 0, "the 4-rank run should have been killed"
        seen["crash"] = records(out, "reshard-crash", 4)
        seen["tracker"] = {name: (base / name / "latest_checkpointed_iteration.txt").read_text() for name in LAYOUTS}
        for name in RESHARDED:  # storage holds nothing readable now: a load from it would fail
            os.rename(base / name / "iter_0000002", base / f"{name}-iter_0000002")
        resumed = launch("reshard-resume", base, out, "--layouts", ",".join(LAYOUTS))
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
        seen["resume"] = records(out, "reshard-resume", 2)
        yield seen
    finally:  # the killed 4-rank job's memory (the resumed job freed its own)
        for name in LAYOUTS:
            subprocess.run([sys.executable, "-m", "flashckpt_integrations.cli", "clean", str(base / name)],
                           env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("layout", RESHARDED)
def test_a_job_relaunched_on_fewer_ranks_resumes_from_the_old_ranks_memory(runs, layout):
    crashed = [ok(rec[layout]) for rec in runs["crash"]]
    assert [rec["committed"] for rec in crashed] == [[2, True, None]] * 4
    assert {rec["status"] for rec in crashed} == {"in_memory"} and runs["tracker"][layout] == "2"
    assert {rec["data_parallel_size"] for rec in crashed} == {4}
    for resumed in runs["resume"]:
        resumed = ok(resumed[layout])
        assert resumed["data_parallel_size"] == 2
        assert resumed["source"] == [3, "memory"]  # iteration 2's files were gone: nothing read from storage
        assert resumed["loaded_iteration"] == 3 and resumed["loaded_flops"] == 300
        # the whole model (and a plain optimizer's Adam moments) as the 4 ranks saved it at iteration 3
        assert resumed["global"] == crashed[0]["global"]
        if layout == "distopt":  # the distributed optimizer's moments, resharded from 4 ranks onto 2
            assert resumed["optimizer_global"] == crashed[0]["optimizer_global"]
        assert resumed["consumed_train_samples"] == crashed[0]["consumed_train_samples"] == 24  # the data position
        assert resumed["rng"] == crashed[0]["rng"]  # data-parallel rank 0's RNG states, as from storage
        assert resumed["committed"] == [4, True, None]  # saving goes on after the resume,
        assert resumed["committed_steps"] == [2, 4]  # in the old job's lineage (its commit stays visible)
        assert [m.split("] ", 1)[1] for m in resumed["warnings"]] == [  # nothing left out (the only WARNING)
            "flashckpt: resumed iteration 3 from the shared memory of a job of 4 ranks, resharded onto 2 ranks "
            "(tp 1, pp 1, ep 1, cp 1, dp 2)"]


def test_a_legacy_format_iteration_in_memory_that_cannot_be_resharded_is_named_before_storage_is_read(runs):
    crashed = [ok(rec["dp-torch"]) for rec in runs["crash"]]
    resumed = [ok(rec["dp-torch"]) for rec in runs["resume"]]
    for rec in resumed:  # Megatron's own load of the commit, with the new data-parallel size
        assert rec["source"] == [2, "storage"] and rec["loaded_iteration"] == 2 and rec["data_parallel_size"] == 2
        assert rec["consumed_train_samples"] == 16 and rec["global"] != crashed[0]["global"]
    assert [m.split("] ", 1)[1] for m in resumed[0]["warnings"]] == [
        "flashckpt: iteration 3 is in this node's memory, saved by a job of 4 ranks, but this job of 2 ranks cannot "
        "resume from it (--ckpt-format torch is not resharded from memory); Megatron loads the newest commit (2) "
        "from storage instead. Relaunch with 4 ranks to resume from memory."]
    assert resumed[1]["warnings"] == []  # (rank 0 names it)
