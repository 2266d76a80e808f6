"""The Megatron-LM patch on Megatron's default checkpoint format, ``--ckpt-format torch_dist``.

Real save_checkpoint / load_checkpoint on 2 CPU ranks (gloo), in three launches shared by every
test here (see ``dist_worker.py``): a patched run per layout that is SIGKILLed right after two
memory-only snapshots (and a job whose saver and trainers are killed mid-persist), a patched
relaunch that resumes from memory, and a process running Megatron's own loader only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("megatron.training.checkpointing")

from tests.distributed.launch import free_port, torchrun_cmd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TRACKER = "latest_checkpointed_iteration.txt"
LAYOUTS = ["tp2", "pp2", "dp2", "ep2"]
FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
STOCK_JOBS = ["tp2:tp2:tp2", "tp2:tp2:tp1", "pp2:pp2:pp2", "pp2:pp2:pp1", "dp2:dp2:dp2", "ep2:ep2:ep2",
              "killpersist:tp2:tp2"]


def launch(mode: str, base, out, *args: str, ours: bool = True, timeout: float = 400, nproc: int = 2
           ) -> subprocess.CompletedProcess:
    cmd = [*torchrun_cmd(nproc, free_port()), os.path.join(HERE, "dist_worker.py"), "--mode", mode, "--base", str(base),
           "--out", str(out), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHCKPT_")}
    env.update({"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONWARNINGS": "ignore",
                "FLASHCKPT_TEST_WRITE_DELAY": "0.5"})
    if ours:
        env["PYTHONPATH"] = REPO
    else:  # nothing of this repository on the path: Megatron and the test model only
        env.pop("PYTHONPATH", None)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=HERE)


def records(out, mode: str, world: int = 2) -> list[dict]:
    result = []
    for rank in range(world):
        with open(os.path.join(out, f"{mode}-{rank}.json")) as f:
            result.append(json.load(f))
    return result


def files_of(step_dir) -> list[str]:
    return sorted(os.listdir(step_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """crash -> (storage hidden) resume -> stock loads; the records of each, and what was on storage."""
    base, out = tmp_path_factory.mktemp("mdist"), tmp_path_factory.mktemp("mdist-out")
    seen: dict = {}
    try:
        crashed = launch("crash", base, out, "--layouts", ",".join([*LAYOUTS, "killpersist"]))
        assert crashed.returncode != 0, "the crash run should have been killed"
        seen["crash"] = records(out, "crash")
        seen["after_crash"] = {name: {"tracker": (base / name / TRACKER).read_text(),
                                      "iterations": sorted(n for n in os.listdir(base / name) if n.startswith("iter_")),
                                      "staging": sorted(os.listdir(base / name / ".flashckpt" / "staging"))
                                      if (base / name / ".flashckpt" / "staging").exists() else []}
                               for name in [*LAYOUTS, "killpersist"]}
        seen["files_4"] = {name: files_of(base / name / "iter_0000004") for name in LAYOUTS}
        seen["config_4"] = (base / "tp2" / "iter_0000004" / "metadata.json").read_text()
        for name in LAYOUTS:  # storage holds nothing readable now: a load from it would fail
            os.rename(base / name / "iter_0000004", base / f"{name}-iter_0000004")
        resumed = launch("resume", base, out, "--layouts", ",".join(LAYOUTS))
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
        seen["resume"] = records(out, "resume")
        for name in LAYOUTS:
            os.rename(base / f"{name}-iter_0000004", base / name / "iter_0000004")
        seen["files_8"] = {name: files_of(base / name / "iter_0000008") for name in LAYOUTS}
        seen["tracker_8"] = {name: (base / name / TRACKER).read_text() for name in LAYOUTS}
        seen["sizes_8"] = {name: [os.path.getsize(base / name / "iter_0000008" / f"__{r}_0.distcp") for r in range(2)]
                           for name in LAYOUTS}
        stock = launch("stock", base, out, "--jobs", ",".join(STOCK_JOBS), ours=False)
        assert stock.returncode == 0, stock.stdout[-3000:] + stock.stderr[-5000:]
        seen["stock"] = records(out, "stock")
        yield seen
    finally:  # the killed job's memory (the resumed jobs freed theirs)
        subprocess.run([sys.executable, "-m", "flashckpt_integrations.cli", "clean", str(base / "killpersist")],
                       env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)


def ok(rec: dict) -> dict:
    assert "error" not in rec, rec.get("traceback")
    return rec


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_writes_torch_dist_files_and_the_tracker_only_at_commit(runs, layout):
    for rec in runs["crash"]:
        rec = ok(rec[layout])
        assert rec["status"] == {"1": "in_memory", "2": "in_memory", "3": "in_memory", "4": "persisting",
                                 "5": "in_memory", "6": "in_memory"}
        assert rec["committed"] == [4, True, None]
    # memory-only saves left nothing on storage; the tracker names the commit
    assert runs["after_crash"][layout] == {"tracker": "4", "iterations": ["iter_0000004"], "staging": []}
    assert runs["files_4"][layout] == FILES == runs["files_8"][layout]
    assert json.loads(runs["config_4"]) == {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    assert runs["tracker_8"][layout] == "8"  # a save after the memory resume commits too
    if layout == "dp2":  # --ckpt-fully-parallel-save spread the replicated model over both ranks' files
        small, big = sorted(runs["sizes_8"][layout])
        assert small > big / 3, runs["sizes_8"][layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kill_after_memory_only_snapshots_resumes_from_memory_bit_exact(runs, layout):
    for crashed, resumed in zip(runs["crash"], runs["resume"]):
        crashed, resumed = ok(crashed[layout]), ok(resumed[layout])
        assert resumed["source"] == [6, "memory"]  # iteration 4's files were gone: nothing read from storage
        assert resumed["loaded_iteration"] == 6 and resumed["loaded_flops"] == 600
        assert resumed["loaded"] == crashed["saved"], "the memory resume restored other parameters or optimizer state"
        assert resumed["final"] == crashed["reference"], "training after the resume differs from the uninterrupted run"
        assert resumed["committed"] == [8, True, None]


@pytest.mark.parametrize("job", STOCK_JOBS)
def test_unpatched_megatron_loads_the_committed_iteration_with_the_same_and_other_sizes(runs, job):
    name, saved, loaded = job.split(":")
    for stock, resumed, crashed in zip(runs["stock"], runs["resume"], runs["crash"]):
        rec = ok(stock[job])
        assert rec["flashckpt_imported"] == [] and rec["flashckpt_refused"] == []
        if name == "killpersist":
            assert rec["loaded_iteration"] == 2 and rec["loaded"] == ok(crashed[name])["saved"]
        elif saved == loaded:  # each rank holds what it held when iteration 8 was saved
            assert rec["loaded_iteration"] == 8 and rec["loaded"] == resumed[name]["final"]
        else:  # TP2 -> TP1, PP2 -> PP1: whole tensors (parameters and Adam moments) by their global names
            assert rec["loaded_iteration"] == 8 and rec["loaded_global"] == resumed[name]["final_global"]


def test_a_kill_of_the_saver_and_the_trainers_mid_persist_leaves_the_previous_iteration(runs):
    for rec in runs["crash"]:
        rec = ok(rec["killpersist"])
        assert rec["committed"] == [2, True, None] and rec["persisting"] == "persisting"
        assert rec["tracker_before_kill"] == "2"
    assert runs["crash"][0]["killpersist"]["killed_savers"], "no saver was running to kill"
    after = runs["after_crash"]["killpersist"]
    assert after["tracker"] == "2" and after["iterations"] == ["iter_0000002"]  # iteration 4 never appeared
    assert [n.split(".")[0] for n in after["staging"]] == ["4"]  # its files were being written aside
    # ... and unpatched Megatron loads iteration 2 (test_unpatched_megatron_loads_..., job killpersist)


def test_megatrons_persistent_checkpoint_worker_is_not_started_under_the_patch(caplog):
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from megatron.training import initialize

    from flashckpt_integrations.adapters import megatron as flash_megatron

    stock = initialize.init_persistent_async_worker
    flash_megatron.patch()
    try:
        with caplog.at_level("INFO", logger=flash_megatron.__name__):
            initialize.init_persistent_async_worker(0, "forkserver")  # what initialize_megatron() calls
            initialize.init_persistent_async_worker(0, "forkserver")
        assert PersistentAsyncCaller._persistent_process is None
        notes = [r for r in caplog.records if "--async-save" in r.getMessage()]
        assert len(notes) == 1 and notes[0].levelname == "INFO" and "no second copy" in notes[0].getMessage()
    finally:
        flash_megatron.unpatch()
    assert initialize.init_persistent_async_worker is stock


def test_the_version_error_names_the_supported_releases_and_what_still_works(monkeypatch):
    from flashckpt_integrations.adapters import megatron as flash_megatron
    from flashckpt_integrations.errors import FlashCkptError

    monkeypatch.setattr(flash_megatron._package_info, "__version__", "0.16.1")
    with pytest.raises(FlashCkptError, match=r"0\.16\.1 is not supported.*0\.19\.x \(the ones that ship "
                                             r"megatron\.training\).*FlashTorchDistSaveStrategy"):
        flash_megatron.patch()
    assert flash_megatron._active is None
