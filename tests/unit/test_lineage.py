"""Attempt lineage and superseding saves: a restart loads only what its own lineage wrote, and a
save of a committed step replaces it atomically, whatever is killed in the middle."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from flashckpt_integrations import Checkpointer
from tests.helpers import kill_savers, run_python

PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from flashckpt_integrations import Checkpointer
    ckpt_dir = sys.argv[1]
    def state(step, seed=0):
        g = torch.Generator().manual_seed(1000 * seed + step)
        return {"w": torch.randn(128, 256, generator=g), "step": step, "seed": seed}
    def files(seed):
        g = torch.Generator().manual_seed(seed)
        return {name: {"t": torch.randn(64, 512, generator=g), "seed": seed} for name in FILES}
    FILES = ["model.pt", "optim.pt", "extra/rng.pt"]
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    """
)

FILES = ["model.pt", "optim.pt", "extra/rng.pt"]


def _files(seed):
    g = torch.Generator().manual_seed(seed)
    return {name: {"t": torch.randn(64, 512, generator=g), "seed": seed} for name in FILES}


def _digest(obj):
    return hashlib.sha1(obj["t"].numpy().tobytes()).hexdigest() + f"/{obj['seed']}"


def _run(code, ckpt, env=None):
    out = run_python(PRELUDE + textwrap.dedent(code), ckpt, env=env)
    return out


def test_lineage_a_fresh_b_then_c_resumes_b_never_a(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # A: commits 10 and 20, then a memory-only snapshot of 25, and is killed.
    out = _run("""
        ck = Checkpointer(ckpt_dir)
        assert ck.load() is None
        assert ck.save(10, state(10, seed=1)).wait(60).committed
        assert ck.save(20, state(20, seed=1)).wait(60).committed
        assert ck.save(25, state(25, seed=1), persist=False).ok
        die()
    """, ckpt)
    assert out.returncode == -signal.SIGKILL, out.stderr
    # B: the same command without a resume (no load): starts from scratch, snapshots 12, is killed.
    # A's snapshot of 25 is still in the other slot.
    out = _run("""
        ck = Checkpointer(ckpt_dir)
        assert ck.save(12, state(12, seed=2), persist=False).ok
        assert sorted(ck.memory_steps()) == [12], ck.memory_steps()
        die()
    """, ckpt)
    assert out.returncode == -signal.SIGKILL, out.stderr
    # C resumes: B's 12, never A's 25 (newer, but abandoned) nor A's commits.
    out = _run("""
        ck = Checkpointer(ckpt_dir)
        assert ck.committed_steps() == [], ck.committed_steps()
        loaded = ck.load()
        assert (loaded.step, loaded.source) == (12, "memory"), (loaded.step, loaded.source)
        assert torch.equal(loaded.state["w"], state(12, seed=2)["w"]) and loaded.state["seed"] == 2
        die()
    """, ckpt)
    assert out.returncode == -signal.SIGKILL, out.stderr
    # D, a restart of C that saved nothing: C continued B's lineage, so D resumes 12 again.
    out = _run("""
        with Checkpointer(ckpt_dir) as ck:
            loaded = ck.load()
            assert (loaded.step, loaded.source, loaded.state["seed"]) == (12, "memory", 2)
            assert ck.save(14, state(14, seed=2)).wait(60).committed
            assert ck.committed_steps() == [14]
        print("ok")
    """, ckpt)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    # A's commits are still on storage (nobody asked to delete them), but not in D's lineage; the
    # tracker names D's newest commit, not A's higher step.
    assert (tmp_path / "ckpt" / "latest").read_text() == "14\n"
    # A and B (fresh starts) were recorded when they began; C resumed and saved nothing, so it left no
    # record; D, which saved, continues B (the lineage that wrote step 12).
    records = sorted(os.listdir(tmp_path / "ckpt" / ".flashckpt" / "lineages"))
    parents = [json.loads((tmp_path / "ckpt" / ".flashckpt" / "lineages" / r).read_text())["parent"] for r in records]
    assert parents == [None, None, 2], records


def test_a_deleted_directory_invalidates_its_snapshots(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = _run("""
        ck = Checkpointer(ckpt_dir)
        assert ck.save(5, state(5)).wait(60).committed
        assert ck.save(7, state(7), persist=False).ok
        die()
    """, ckpt)
    assert out.returncode == -signal.SIGKILL, out.stderr
    shutil.rmtree(ckpt)  # the user asks for a fresh start
    with Checkpointer(ckpt) as ck:
        assert ck.load() is None
        assert ck.memory_steps() == []  # discarded, not only skipped
        assert ck.save(1, {"w": torch.ones(3)}).wait(60).committed
        assert ck.committed_steps() == [1]


def test_a_snapshot_of_a_replaced_directory_is_not_persisted_into_the_new_one(make_checkpointer, tmp_path):
    ck = make_checkpointer()
    assert ck.save(1, {"w": torch.ones(4)}).wait(60).committed
    shutil.rmtree(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    result = ck.save(2, {"w": torch.zeros(4)}).wait(60)
    assert not result.committed and "deleted or replaced" in result.error
    assert not (tmp_path / "ckpt" / "step-2").exists()


def _stock_digests(step_dir):
    """Each file of a step directory, loaded by torch in a process that never imports us."""
    code = textwrap.dedent("""
        import hashlib, json, sys, torch
        assert "flashckpt_integrations" not in sys.modules
        out = {}
        for name in sys.argv[2:]:
            obj = torch.load(f"{sys.argv[1]}/{name}", weights_only=True)
            out[name] = hashlib.sha1(obj["t"].numpy().tobytes()).hexdigest() + f"/{obj['seed']}"
        assert "flashckpt_integrations" not in sys.modules
        print(json.dumps(out))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(step_dir), *FILES], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _which(digests, label):
    old = {n: _digest(o) for n, o in _files(1).items()}
    new = {n: _digest(o) for n, o in _files(2).items()}
    if digests == old:
        return "old"
    if digests == new:
        return "new"
    raise AssertionError(f"{label}: a mix of two saves or neither: {digests}")


def _our_digests(ckpt):
    """What our loader reads (another job id: its saver leaves the crashed job's slots alone)."""
    with Checkpointer(ckpt, job_id="inspector") as ck:
        loaded = ck.load(4, prefer_memory=False)
    return {name: _digest(obj) for name, obj in loaded.files.items()}


@pytest.mark.parametrize("point", ["saver.write@2", "saver.commit", "saver.supersede", "trainer.sealed"])
def test_a_crash_in_the_middle_of_a_superseding_save_leaves_old_or_new_never_a_mix(tmp_path, point):
    ckpt = str(tmp_path / "ckpt")
    out = _run("""
        with Checkpointer(ckpt_dir) as ck:
            assert ck.save(4, files=files(1)).wait(60).committed
    """, ckpt)
    assert out.returncode == 0, out.stderr
    # A new attempt (no resume) saves step 4 again; its saver (or itself) is killed at `point`.
    out = _run("""
        import time
        ck = Checkpointer(ckpt_dir)
        print("run_dir", ck.run_dir, flush=True)
        while not ck.client.connected:  # the knob is armed in the first saver only, not in a restarted one
            time.sleep(0.005)
        os.environ.pop("FLASHCKPT_FAULT")
        r = ck.save(4, files=files(2))
        r.wait(60)
        die()
    """, ckpt, env={"FLASHCKPT_FAULT": point})
    assert out.returncode == -signal.SIGKILL, out.stderr
    run_dir = out.stdout.split("run_dir ", 1)[1].split()[0]
    kill_savers(run_dir)
    step_dir = tmp_path / "ckpt" / "step-4"
    ours = _which(_our_digests(ckpt), "our loader after the crash")
    record = tmp_path / "ckpt" / ".flashckpt" / "steps" / "4" / "COMMITTED"
    # trainer.sealed kills the trainer only: its saver runs on until kill_savers() and may be caught
    # in the middle of moving the new save into place, as saver.supersede is by design
    switching = point == "saver.supersede" or (
        point == "trainer.sealed" and "final_dir" in json.loads(record.read_text()))
    if not switching:
        assert _which(_stock_digests(step_dir), "the step directory after the crash") == ours
    else:  # switched: the new files load, from wherever the move into place got to
        assert ours == "new"
        # the step's own directory holds the old save, nothing (between the two renames), or the new
        # one: a stock loader may find no file there until recovery, never a mix
        if all((step_dir / name).exists() for name in FILES):
            _which(_stock_digests(step_dir), "the step directory after the crash")
    # Whatever a restart's saver finishes, the directory holds one whole save, the same one we load.
    out = _run("""
        import json, time
        record = os.path.join(ckpt_dir, ".flashckpt", "steps", "4", "COMMITTED")
        with Checkpointer(ckpt_dir) as ck:  # its saver recovers what the killed attempt left
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                committed = json.load(open(record))
                if committed["sid"] != "a1" and "final_dir" not in committed:
                    break  # the new save is committed and in place
                time.sleep(0.1)
    """, ckpt)
    assert out.returncode == 0, out.stderr
    stock = _which(_stock_digests(step_dir), "the step directory after recovery")
    ours = _which(_our_digests(ckpt), "our loader after recovery")
    assert stock == ours
    if point in ("saver.supersede", "trainer.sealed"):
        assert stock == "new"


def test_a_first_save_returns_before_its_attempt_record_and_is_usable_only_once_recorded(
        make_checkpointer, tmp_path, monkeypatch):
    """The first save of an attempt writes the attempt's record beside its copy. It returns once
    copied, however slow the record's write; its slot is sealed (usable, persisted) only after."""
    from flashckpt_integrations.core import lineage
    from flashckpt_integrations.core.shm_buffer import SlotState

    written, release, fail = threading.Event(), threading.Event(), [True]
    publish = lineage.publish

    def slow_publish(storage, record):  # storage that takes its time (and fails once)
        release.wait(60)
        if fail and fail.pop():
            raise OSError("the storage said no")
        answer = publish(storage, record)
        written.set()
        return answer

    monkeypatch.setattr(lineage, "publish", slow_publish)
    ck = make_checkpointer()
    records = tmp_path / "ckpt" / lineage.LINEAGE_DIR
    first = ck.save(1, {"w": torch.full((256, 256), 1.0)}, persist=False)
    assert first.ok and first.status.value == "in_memory"
    states = [s.read_header().state for s in map(ck.slots.mapped, range(ck.slots.count)) if s is not None]
    assert SlotState.COMPLETE not in states, "a slot was sealed before its attempt was recorded"
    release.set()  # the write fails: the snapshot is dropped, with the reason
    assert ck.memory_steps() == []
    assert first.status.value == "failed" and "the storage said no" in first.reason
    assert not written.is_set() and not (records.exists() and any(records.iterdir()))

    second = ck.save(2, {"w": torch.full((256, 256), 2.0)})  # tries the record again
    assert second.wait(60).committed
    assert written.is_set() and any(records.iterdir())
    assert ck.memory_steps() == [2]
    assert torch.equal(ck.load().state["w"], torch.full((256, 256), 2.0))
