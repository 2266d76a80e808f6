"""The flashckpt command on real checkpoints."""

import json
import os
import subprocess
import sys

import torch


def flashckpt(*args):
    shm = ["--shm-dir", os.environ["FLASHCKPT_SHM_DIR"]]
    return subprocess.run([sys.executable, "-m", "flashckpt_integrations.cli", *shm, *args], capture_output=True,
                          text=True, timeout=120)


def test_ls_inspect_clean(make_checkpointer, tmp_path):
    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt)
    assert ck.save(1, {"w": torch.ones(1000)}).wait(60).committed
    ck.save(2, {"w": torch.ones(1000)}, persist=False)

    listing = json.loads(flashckpt("ls", str(ckpt), "--json").stdout)
    assert listing["committed"] == [1]
    assert sorted((m["rank"], m["step"], m["state"]) for m in listing["memory"]) == [(0, 1, "complete"),
                                                                                      (0, 2, "complete")]
    assert "committed steps: 1" in flashckpt("ls", str(ckpt)).stdout

    shown = json.loads(flashckpt("inspect", str(ckpt), "1", "--json").stdout)
    (entry,) = shown["ranks"][0]["files"]
    assert entry["path"] == "rank-0.pt" and entry["size"] == os.path.getsize(ckpt / "step-1" / "rank-0.pt")
    missing = flashckpt("inspect", str(ckpt), "2")
    assert missing.returncode == 1 and "not committed" in missing.stderr

    assert "removed 2" in flashckpt("clean", str(ckpt)).stdout
    assert not any(os.path.exists(p) for p in ck.slot_paths)


def test_clean_and_ls_find_the_memory_of_a_job_named_by_the_environment(tmp_path):
    """A job named by ``$FLASHCKPT_JOB_ID`` (not by its directory), which exited without close:
    ``flashckpt`` run with the same environment (the job id and the shm-dir knob, no flags)
    finds its slots and removes them."""
    import glob
    import uuid

    from flashckpt_integrations.core.client import job_key
    from tests.helpers import kill_savers, run_python

    ckpt = str(tmp_path / "ckpt")
    job_id = f"env-named-{uuid.uuid4().hex[:8]}"
    env = {"FLASHCKPT_JOB_ID": job_id}
    child = (
        "import os, sys, torch\n"
        "from flashckpt_integrations import Checkpointer\n"
        "ck = Checkpointer(sys.argv[1])\n"
        "assert ck.save(1, {'w': torch.ones(1000)}, persist=False).status.value == 'in_memory'\n"
        "print(ck.run_dir, flush=True)\n"
        "os._exit(0)\n"  # no close, no atexit: the memory stays
    )
    done = run_python(child, ckpt, env=env)
    assert done.returncode == 0, done.stderr
    run_dir = done.stdout.strip()
    pattern = os.path.join(os.environ["FLASHCKPT_SHM_DIR"], f"flashckpt-{os.getuid()}-{job_key(job_id)}-r0-*")
    try:
        slots = glob.glob(pattern)
        assert slots, "the job's slots are named by its job id, in the knob's shm dir"
        cli_env = {**os.environ, **env}
        run = [sys.executable, "-m", "flashckpt_integrations.cli"]
        listing = subprocess.run([*run, "ls", ckpt, "--json"], env=cli_env, capture_output=True, text=True,
                                 timeout=120)
        memory = json.loads(listing.stdout)["memory"]
        assert (0, 1) in [(m["rank"], m["step"]) for m in memory] and len(memory) == len(slots), listing.stderr
        cleaned = subprocess.run([*run, "clean", ckpt], env=cli_env, capture_output=True, text=True, timeout=120)
        assert cleaned.returncode == 0 and f"removed {len(slots)} shared-memory slot(s)" in cleaned.stdout, (
            cleaned.stdout + cleaned.stderr)
        assert glob.glob(pattern) == []
    finally:
        kill_savers(run_dir)
        for path in glob.glob(pattern):
            os.unlink(path)
