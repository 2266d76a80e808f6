"""Isolation: another user cannot touch a job's memory or saver; two jobs of one user never mix;
the memory of a dead job is reclaimed by ``flashckpt clean`` and does not confuse the next one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib

import pytest
import torch

from flashckpt_integrations import Checkpointer
from tests.faults import harness
from tests.faults.job import JobConfig, reference
from tests.helpers import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

OTHER_UID = 65534  # nobody

OTHER_USER = textwrap.dedent(
    """
    import json, os, socket, sys
    import torch
    from flashckpt_integrations import Checkpointer
    from flashckpt_integrations.core.shm_buffer import Slot
    from flashckpt_integrations.errors import SharedMemoryError
    args = json.loads(sys.argv[1])
    # Python lives under /root here, out of the other user's reach: import first, then become them.
    os.setgroups([]); os.setgid(args["uid"]); os.setuid(args["uid"])
    report = {"uid": os.getuid()}
    def attempt(name, fn):
        try:
            fn()
            report[name] = "allowed"
        except (OSError, SharedMemoryError) as exc:
            report[name] = f"{type(exc).__name__}: {exc}"
    for i, path in enumerate(args["slots"]):
        attempt(f"read-{i}", lambda: open(path, "rb").read(1))
        attempt(f"attach-{i}", lambda: Slot.attach(path))
    attempt("connect", lambda: socket.socket(socket.AF_UNIX).connect(args["socket"]))
    attempt("list-run-dir", lambda: os.listdir(args["run_dir"]))
    ck = Checkpointer(args["ckpt"], job_id=args["job_id"])  # the same job id, its own user
    assert ck.save(7, {"w": torch.full((4,), 7.0)}, persist=False).ok
    loaded = ck.load()
    report["own"] = {"step": loaded.step, "source": loaded.source, "w": loaded.state["w"].tolist(),
                     "slots": ck.slot_paths}
    ck.close(wait=False)
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)
    """
)


@pytest.fixture
def shared_dirs(monkeypatch):
    """World-writable, sticky shm and run-dir bases, like /dev/shm and /tmp (the tests' own are private)."""
    made = [tempfile.mkdtemp(prefix="flashckpt-iso-", dir="/dev/shm"), tempfile.mkdtemp(prefix="flashckpt-iso-")]
    for path in made:
        os.chmod(path, 0o1777)
    monkeypatch.setenv("FLASHCKPT_SHM_DIR", made[0])
    monkeypatch.setenv("FLASHCKPT_RUN_DIR", made[1])
    yield made
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def test_another_user_cannot_read_attach_or_connect_and_keeps_its_own_memory(shared_dirs):
    if os.geteuid() != 0:
        pytest.skip("running a process as another user (uid 65534) needs root")
    theirs = tempfile.mkdtemp(prefix="flashckpt-iso-ckpt-")
    os.chmod(theirs, 0o777)
    mine = os.path.join(shared_dirs[1], "mine")
    try:
        with Checkpointer(mine, job_id="shared-name") as ck:
            assert ck.save(1, {"w": torch.full((4,), 1.0)}).wait(60).committed  # the saver is up
            args = {"uid": OTHER_UID, "slots": ck.slot_paths, "socket": os.path.join(ck.run_dir, "saver.sock"),
                    "run_dir": ck.run_dir, "ckpt": theirs, "job_id": "shared-name"}
            assert os.path.exists(args["socket"]) and all(os.stat(p).st_mode & 0o777 == 0o600 for p in ck.slot_paths)
            out = subprocess.run([sys.executable, "-c", OTHER_USER, json.dumps(args)], capture_output=True, text=True,
                                 timeout=120, env={**os.environ, "PYTHONPATH": REPO, "HOME": "/tmp"})
            assert out.returncode == 0, out.stderr[-3000:]
            report = json.loads(out.stdout.strip().splitlines()[-1])
            assert report["uid"] == OTHER_UID
            for key in ("read-0", "read-1", "attach-0", "attach-1", "connect", "list-run-dir"):
                assert "Permission denied" in report[key], (key, report[key])
            assert report["own"]["step"] == 7 and report["own"]["source"] == "memory"
            assert report["own"]["w"] == [7.0] * 4
            assert all(f"flashckpt-{OTHER_UID}-" in os.path.basename(p) for p in report["own"]["slots"])
            assert set(report["own"]["slots"]).isdisjoint(ck.slot_paths)
            loaded = ck.load()  # ours is untouched
            assert (loaded.step, loaded.source) == (1, "memory") and torch.equal(loaded.state["w"], torch.ones(4))
    finally:
        shutil.rmtree(theirs, ignore_errors=True)


def test_two_jobs_of_one_user_in_parallel_each_resume_their_own_state(tmp_path, run_base):
    # one run-dir base and one shm dir for both jobs, as on a real host
    configs = [JobConfig(seed=1), JobConfig(seed=2)]
    refs = [reference(cfg) for cfg in configs]
    steps = configs[0].steps
    assert not torch.equal(refs[0][steps]["model"]["0.weight"], refs[1][steps]["model"]["0.weight"])
    outcomes = [None, None]

    def run(i: int) -> None:
        case = harness.Case(seed=i, point="trainer.sealed", visit=5 + 3 * i, rank=i)
        workdir = tmp_path / f"job-{i}"
        workdir.mkdir()
        outcomes[i] = harness.run_case(case, configs[i], refs[i], str(workdir), run_base)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for outcome in outcomes:
        assert outcome.passed, harness.describe(outcome)
        assert outcome.relaunched and outcome.resumed is not None


def test_clean_reclaims_a_dead_jobs_memory_and_the_next_job_starts_from_storage(tmp_path, run_base):
    cfg = JobConfig()
    ref = reference(cfg)
    ckpt = str(tmp_path / "ckpt")
    env = harness.job_env(run_base)
    shm = os.environ["FLASHCKPT_SHM_DIR"]
    # the job dies after its step-7 snapshot, and so does its saver: a dead job's memory and socket stay
    codes = harness.launch(cfg, ckpt, str(tmp_path / "run1"), env, {0: "trainer.sealed@7"})
    assert codes[0] == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(ckpt, ".flashckpt", "steps", "6", "COMMITTED")):
        assert time.monotonic() < deadline, "step 6 was never committed"
        time.sleep(0.05)
    harness.stop_savers(run_base, ckpt)
    (run_dir,) = [d for d in os.listdir(os.path.join(run_base, f"flashckpt-{os.getuid()}"))]
    run_dir = os.path.join(run_base, f"flashckpt-{os.getuid()}", run_dir)
    assert os.path.exists(os.path.join(run_dir, "saver.sock"))  # stale: nobody listens

    listing = json.loads(flashckpt(env, "ls", ckpt, "--json").stdout)
    assert listing["committed"] == [3, 6]
    assert len(listing["memory"]) == 4 and {m["rank"] for m in listing["memory"]} == {0, 1}
    assert {m["step"] for m in listing["memory"] if m["rank"] == 0} == {6, 7}
    shown = json.loads(flashckpt(env, "inspect", ckpt, "6", "--json").stdout)
    assert shown["commit"]["world_size"] == 2 and [r["rank"] for r in shown["ranks"]] == [0, 1]
    for row in shown["ranks"]:
        (entry,) = row["files"]
        data = open(os.path.join(ckpt, "step-6", entry["path"]), "rb").read()
        assert (entry["size"], entry["crc32"]) == (len(data), zlib.crc32(data))

    cleaned = flashckpt(env, "clean", ckpt)
    assert cleaned.returncode == 0 and "removed 4 shared-memory slot(s) and 1 saver run" in cleaned.stdout
    assert not [n for n in os.listdir(shm) if n.startswith(f"flashckpt-{os.getuid()}-")]
    assert not os.path.exists(run_dir)
    assert json.loads(flashckpt(env, "ls", ckpt, "--json").stdout)["memory"] == []

    # the next job of the same name starts from the newest commit, and ends where the reference does
    out = str(tmp_path / "run2")
    try:
        codes = harness.launch(cfg, ckpt, out, env)
        assert codes == [0, 0], open(os.path.join(out, "rank-0.log")).read()[-3000:]
        record = json.load(open(os.path.join(out, "rank-0.json")))
        assert (record["resumed"], record["source"]) == (6, "storage")
        assert harness.wait_for_savers(run_base, ckpt)
        assert harness.check(ckpt, cfg, ref, out) == []
    finally:
        harness.stop_savers(run_base, ckpt)


def test_clean_keeps_the_run_directory_of_a_live_saver(make_checkpointer, tmp_path, monkeypatch, run_base):
    monkeypatch.setenv("FLASHCKPT_RUN_DIR", run_base)
    ck = make_checkpointer(tmp_path / "ckpt")
    assert ck.save(1, {"w": torch.ones(8)}).wait(60).committed  # its saver runs
    cleaned = flashckpt(dict(os.environ), "clean", str(tmp_path / "ckpt"))
    assert cleaned.returncode == 0 and "its saver is still running" in cleaned.stderr
    assert os.path.exists(os.path.join(ck.run_dir, "saver.sock"))


def test_a_run_directory_too_deep_for_a_socket_is_a_clear_error(tmp_path, monkeypatch):
    from flashckpt_integrations import SaverProcessError

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("FLASHCKPT_RUN_DIR", str(deep))
    with pytest.raises(SaverProcessError, match="FLASHCKPT_RUN_DIR.*shorter directory"):
        Checkpointer(tmp_path / "ckpt")


def flashckpt(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    shm = ["--shm-dir", env.get("FLASHCKPT_SHM_DIR", os.environ["FLASHCKPT_SHM_DIR"])]
    return subprocess.run([sys.executable, "-m", "flashckpt_integrations.cli", *shm, *args], capture_output=True,
                          text=True, timeout=120, env={**env, "PYTHONPATH": REPO})
