"""Crashes and slot reuse never yield a torn or lost checkpoint, and never a silent one."""

import os
import signal
import textwrap
import time

import pytest
import torch

from flashckpt_integrations import Checkpointer, SaveStatus
from flashckpt_integrations.core.layout import read_json
from flashckpt_integrations.core.shm_buffer import Slot, SlotState
from tests.helpers import run_python

CHILD_PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from flashckpt_integrations import Checkpointer
    ckpt_dir = sys.argv[1]
    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1024, generator=g), "step": step}
    """
)


def expected(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1024, generator=g), "step": step}


def test_kill_after_memory_only_save_restores_from_memory_without_reading_storage(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    child = CHILD_PRELUDE + textwrap.dedent(
        """
        ck = Checkpointer(ckpt_dir)
        assert ck.save(1, state(1)).wait(60).committed
        r = ck.save(2, state(2), persist=False)
        assert r.status.value == "in_memory", r
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = run_python(child, ckpt)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # Storage holds only step 1; step 2 can only come from memory.
    assert sorted(os.listdir(ckpt)) == [".flashckpt", "latest", "step-1"]
    os.rename(os.path.join(ckpt, "step-1"), os.path.join(ckpt, "step-1.hidden"))  # storage must not be read
    with Checkpointer(ckpt) as ck:
        assert ck.committed_steps() == [1]
        loaded = ck.load()
        assert (loaded.step, loaded.source) == (2, "memory")
        assert torch.equal(loaded.state["w"], expected(2)["w"]) and loaded.state["step"] == 2


def test_kill_mid_copy_leaves_the_previous_snapshot_loadable(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    child = CHILD_PRELUDE + textwrap.dedent(
        """
        import flashckpt_integrations.core.checkpointer.saving as engine
        ck = Checkpointer(ckpt_dir)
        assert ck.save(1, state(1), persist=False).ok
        real_copy = engine.copy_regions
        def copy_then_die(plan, slot, on_copied=None, targets=None):
            plan.regions = plan.regions[:1]  # copy part of the state, then crash
            real_copy(plan, slot, on_copied, targets)
            os.kill(os.getpid(), signal.SIGKILL)
        engine.copy_regions = copy_then_die
        ck.save(2, state(2), persist=False)
        """
    )
    proc = run_python(child, ckpt)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with Checkpointer(ckpt) as ck:
        states = [Slot.attach(p).read_header().state for p in ck.slot_paths]
        assert sorted(states) == [SlotState.WRITING, SlotState.COMPLETE]
        assert ck.memory_steps() == [1]
        loaded = ck.load()
        assert (loaded.step, loaded.source) == (1, "memory")
        assert torch.equal(loaded.state["w"], expected(1)["w"])


def test_kill_mid_copy_of_a_streaming_persist_never_publishes_the_step(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    child = CHILD_PRELUDE + textwrap.dedent(
        """
        import time
        import flashckpt_integrations.core.checkpointer.saving as engine
        ck = Checkpointer(ckpt_dir, stream_persist=True)
        assert ck.save(1, state(1)).wait(60).committed
        real_copy = engine.copy_regions
        def copy_then_die(plan, slot, on_copied=None, targets=None):
            assert on_copied is not None, "the persist must stream"
            plan.regions = plan.regions[:1]
            real_copy(plan, slot, on_copied, targets)  # region 0 is in place: the saver streams it
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        engine.copy_regions = copy_then_die
        ck.save(2, state(2))
        """
    )
    proc = run_python(child, ckpt)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    failed = os.path.join(ckpt, ".flashckpt", "steps", "2", "FAILED")
    deadline = time.monotonic() + 60
    while not os.path.exists(failed):
        assert time.monotonic() < deadline, "the abandoned streaming persist was never marked failed"
        time.sleep(0.1)
    assert "disconnected" in open(failed).read() or "failed" in open(failed).read()
    assert not os.path.exists(os.path.join(ckpt, "step-2", "rank-0.pt"))
    with Checkpointer(ckpt) as ck:
        assert ck.committed_steps() == [1]
        loaded = ck.load()
        assert (loaded.step, loaded.source) == (1, "memory")
        assert torch.equal(loaded.state["w"], expected(1)["w"])


def test_streaming_persist_round_trip(make_checkpointer):
    ck = make_checkpointer(stream_persist=True)
    for step in (1, 2, 3):
        assert ck.save(step, expected(step)).wait(60).committed
    for step in (2, 3):
        assert torch.equal(ck.load(step, prefer_memory=False).state["w"], expected(step)["w"])


def test_memory_save_right_after_a_persisting_save_loses_nothing(make_checkpointer, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHCKPT_TEST_WRITE_DELAY", "1.5")
    ck = make_checkpointer(storage_factory="tests.helpers:SlowStorage")
    first = ck.save(10, expected(10))
    second = ck.save(11, expected(11), persist=False)
    assert first.status is SaveStatus.PERSISTING and second.status is SaveStatus.IN_MEMORY
    assert second.blocking_s < 1.0, "the memory save must not wait for the slow persist"
    assert first.wait(60).committed
    assert ck.committed_steps() == [10]
    assert ck.memory_steps() == [10, 11]
    loaded = ck.load()
    assert (loaded.step, loaded.source) == (11, "memory")
    from_disk = ck.load(10, prefer_memory=False)
    assert torch.equal(from_disk.state["w"], expected(10)["w"])


def test_third_save_while_both_slots_persist_is_skipped_with_a_reason(make_checkpointer, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_TEST_WRITE_DELAY", "2")
    ck = make_checkpointer(storage_factory="tests.helpers:SlowStorage", on_slot_busy="skip")
    ck.client.connect()  # the saver is up: before it answers, a third save would go to the held slot
    a = ck.save(1, expected(1))
    b = ck.save(2, expected(2))
    c = ck.save(3, expected(3))
    assert (a.status, b.status) == (SaveStatus.PERSISTING, SaveStatus.PERSISTING)
    assert c.status is SaveStatus.SKIPPED and "being persisted" in c.reason and not c.ok
    assert a.wait(60).committed and b.wait(60).committed
    assert ck.committed_steps() == [1, 2]


def test_third_save_waits_for_a_slot_by_default(make_checkpointer, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_TEST_WRITE_DELAY", "1")
    ck = make_checkpointer(storage_factory="tests.helpers:SlowStorage")
    ck.client.connect()  # the saver is up: slow storage, not its start, is what holds both slots
    results = [ck.save(s, expected(s)) for s in (1, 2, 3)]
    assert all(r.status is SaveStatus.PERSISTING for r in results)
    assert results[2].blocking_s > 0.5
    assert all(r.wait(60).committed for r in results)
    assert ck.committed_steps() == [1, 2, 3]


def test_state_growth_between_saves(make_checkpointer):
    ck = make_checkpointer()
    small = {"w": torch.randn(10)}
    ck.save(1, small, persist=False)
    ck.save(2, small, persist=False)
    big = {"w": torch.randn(10), "extra": torch.randn(4 << 20)}
    assert ck.save(3, big).wait(60).committed
    loaded = ck.load()
    assert loaded.step == 3 and torch.equal(loaded.state["extra"], big["extra"])
    sizes = [os.path.getsize(p) for p in ck.slot_paths]
    assert max(sizes) >= big["extra"].nbytes


def test_slots_are_private_and_prepared_ahead(make_checkpointer):
    ck = make_checkpointer()
    ck.prepare({"w": torch.randn(1 << 20)})
    for path in ck.slot_paths:
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
        assert st.st_size >= 4 << 20
        assert os.path.basename(path).startswith(f"flashckpt-{os.getuid()}-{ck.job_key}-r0-")
    run_dir_mode = os.stat(ck.run_dir).st_mode & 0o777
    assert run_dir_mode == 0o700


def test_without_prepare_the_second_slot_is_sized_like_the_first(make_checkpointer):
    # The first save creates its slot with one headroom (GROWTH) over what it needs, and the other
    # slot in the background: sized for the same state, not for the first slot's grown size.
    from flashckpt_integrations.core.shm_buffer import GROWTH

    ck = make_checkpointer()
    state = {"w": torch.randn(4 << 20)}  # 16 MiB
    state_bytes = state["w"].nbytes
    assert ck.save(1, state, persist=False).ok
    deadline = time.monotonic() + 30
    while not all(os.path.exists(p) and os.stat(p).st_size > 0 for p in ck.slot_paths):
        assert time.monotonic() < deadline, "the second slot was never prepared"
        time.sleep(0.01)
    first, second = (os.stat(p).st_size for p in ck.slot_paths)
    assert first == second, (first, second)
    assert state_bytes < second <= state_bytes * (GROWTH + 0.01), (second, state_bytes)
    assert first + second <= 2.1 * state_bytes  # the memory budget README states for two slots


def test_one_slot_halves_the_memory_and_a_save_during_its_persist_is_skipped(make_checkpointer, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_TEST_WRITE_DELAY", "1")
    ck = make_checkpointer(storage_factory="tests.helpers:SlowStorage", on_slot_busy="skip", slots=1)
    state = {"w": torch.randn(4 << 20)}  # 16 MiB
    first = ck.save(1, state)
    assert first.status is SaveStatus.PERSISTING
    during = ck.save(2, expected(2), persist=False)
    assert during.status is SaveStatus.SKIPPED and "the shared-memory slot of rank 0 is" in during.reason
    assert first.wait(60).committed
    assert ck.save(3, state, persist=False).status is SaveStatus.IN_MEMORY
    assert ck.memory_steps() == [3] and ck.committed_steps() == [1]
    assert torch.equal(ck.load(3).state["w"], state["w"])
    assert len(ck.slot_paths) == 1 and os.stat(ck.slot_paths[0]).st_size <= 1.05 * state["w"].nbytes
    with pytest.raises(ValueError, match="slots=3 must be 1 or 2"):
        make_checkpointer(slots=3)


def test_two_jobs_on_one_host_never_see_each_other(make_checkpointer, tmp_path):
    a = make_checkpointer(tmp_path / "job-a")
    b = make_checkpointer(tmp_path / "job-b")
    assert set(a.slot_paths).isdisjoint(b.slot_paths) and a.run_dir != b.run_dir
    a.save(5, {"w": torch.ones(3)}, persist=False)
    assert b.load() is None
    b.save(1, {"w": torch.zeros(3)}, persist=False)
    assert a.load().step == 5 and torch.equal(a.load().state["w"], torch.ones(3))


def test_corrupt_metadata_falls_back_to_the_last_commit(make_checkpointer, caplog):
    ck = make_checkpointer()
    assert ck.save(1, expected(1)).wait(60).committed
    ck.save(2, expected(2), persist=False)
    slot = next(s for s in (Slot.attach(p) for p in ck.slot_paths) if s.read_header().step == 2)
    header = slot.read_header()
    slot.write_blob(header.meta_offset + 5, b"#")  # flip metadata bytes behind the checksum
    loaded = ck.load()
    assert loaded.step == 1  # step 1 is still intact in the other slot and on storage
    assert torch.equal(loaded.state["w"], expected(1)["w"])
    assert any("checksum mismatch" in r.message for r in caplog.records)
    for path in ck.slot_paths:  # with no intact snapshot left, storage serves the last commit
        slot = Slot.attach(path)
        h = slot.read_header()
        slot.write_blob(h.meta_offset + 1, b"#")
    loaded = ck.load()
    assert (loaded.step, loaded.source) == (1, "storage")
    assert torch.equal(loaded.state["w"], expected(1)["w"])


def test_wrong_format_version_is_a_clear_error(make_checkpointer):
    import struct

    from flashckpt_integrations import CorruptCheckpointError

    ck = make_checkpointer()
    ck.save(1, {"w": torch.ones(2)}, persist=False)
    slot = Slot.attach(ck.slot_paths[0])
    slot.write_blob(8, struct.pack("<I", 99))
    try:
        slot.read_header()
    except CorruptCheckpointError as exc:
        assert "format version 99" in str(exc)
    else:
        raise AssertionError("a slot of another format version must not be read")


def test_staging_layout_publishes_the_step_directory_only_at_commit(make_checkpointer, tmp_path, monkeypatch):
    from flashckpt_integrations import Layout

    monkeypatch.setenv("FLASHCKPT_TEST_WRITE_DELAY", "1")
    layout = Layout(step_dir="iter_{step:07d}", tracker="latest_checkpointed_iteration.txt",
                    tracker_content="{step}", staging=True)
    ck = make_checkpointer(layout=layout, storage_factory="tests.helpers:SlowStorage")
    result = ck.save(42, expected(42))
    import time

    time.sleep(0.5)
    assert not (tmp_path / "ckpt" / "iter_0000042").exists(), "a step directory must not appear before commit"
    assert result.wait(60).committed
    assert (tmp_path / "ckpt" / "iter_0000042" / "rank-0.pt").exists()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "42"
    assert torch.equal(ck.load(prefer_memory=False).state["w"], expected(42)["w"])


def test_close_warns_when_the_newest_step_was_only_in_memory(make_checkpointer, caplog):
    ck = make_checkpointer()
    assert ck.save(1, expected(1)).wait(60).committed
    ck.save(2, expected(2), persist=False)
    ck.close()
    assert any("step 2 was only in memory" in r.message for r in caplog.records)


def test_saving_a_committed_step_again_supersedes_it(make_checkpointer, tmp_path):
    ck = make_checkpointer()
    assert ck.save(3, expected(3)).wait(60).committed
    again = ck.save(3, expected(4)).wait(60)
    assert again.committed, again.error
    assert torch.equal(ck.load(3, prefer_memory=False).state["w"], expected(4)["w"])
    markers = sorted(os.listdir(tmp_path / "ckpt" / ".flashckpt" / "steps" / "3"))
    assert markers == ["COMMITTED", "rank-0.a1g1.done"]  # the replaced save's marker is gone
    assert not os.listdir(tmp_path / "ckpt" / ".flashckpt" / "staging")


def test_a_step_whose_first_attempt_failed_can_be_saved_again(make_checkpointer, tmp_path):
    root = tmp_path / "ckpt"
    ck = make_checkpointer(root, storage_factory="tests.helpers:FailingStorage")
    root.mkdir(parents=True, exist_ok=True)
    (root / "FAIL").write_text("")
    assert not ck.save(5, expected(5)).wait(60).committed
    os.unlink(root / "FAIL")
    assert ck.save(5, expected(5)).wait(60).committed
    assert ck.committed_steps() == [5]
    assert torch.equal(ck.load(5, prefer_memory=False).state["w"], expected(5)["w"])


def _wait_committed(ck, step, timeout=60.0):
    deadline = time.monotonic() + timeout
    while step not in ck.committed_steps() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ck.committed_steps()


def _die_with_an_unsent_persist_of_step_1(ckpt: str, before: str = "") -> None:
    """A process of the job (running ``before`` first) seals a snapshot of step 1 with a persist
    request that never reaches the saver, and is SIGKILLed."""
    child = CHILD_PRELUDE + before + textwrap.dedent(
        """
        import time
        ck = Checkpointer(ckpt_dir)
        ck.requests.queue(time.sleep, 60)  # the request to the saver queues behind this and is never sent
        r = ck.save(1, state(1), persist=True)
        assert r.status.value == "persisting", r
        assert ck.wait_for_snapshot() is None  # sealed (a first save seals once its attempt is recorded)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = run_python(child, ckpt)
    assert out.returncode == -signal.SIGKILL, out.stderr


def test_a_persist_the_trainer_asked_for_but_never_handed_over_is_still_committed(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _die_with_an_unsent_persist_of_step_1(ckpt)
    # The node's saver (found or started by the next process of the job) persists and commits it.
    with Checkpointer(ckpt) as ck:
        assert _wait_committed(ck, 1) == [1]
        loaded = ck.load(prefer_memory=False)
    assert loaded.source == "storage" and loaded.step == 1
    for key, value in expected(1).items():
        assert torch.equal(torch.as_tensor(loaded.state[key]), torch.as_tensor(value))
    log = open(os.path.join(ck.run_dir, "saver.log")).read()
    assert "asked to persist step 1 and did not see it through" in log


def test_a_rank_killed_before_its_hello_reached_a_running_saver_has_its_persist_committed(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # An earlier process of the job starts the node's saver and goes away without closing: the
    # saver stays up (a rank was lost), having looked for unsent requests at its start.
    first = CHILD_PRELUDE + textwrap.dedent(
        """
        ck = Checkpointer(ckpt_dir)
        ck.client.connect()
        os._exit(0)
        """
    )
    assert run_python(first, ckpt).returncode == 0
    # The next one never says hello: its persist request is neither sent nor seen at a disconnection.
    _die_with_an_unsent_persist_of_step_1(ckpt, before="Checkpointer._connect_quietly = lambda self: None\n")
    # The process after it says hello to the saver that is still up, which finds the request.
    with Checkpointer(ckpt) as ck:
        assert _wait_committed(ck, 1, timeout=30) == [1]
        loaded = ck.load(prefer_memory=False)
    assert loaded.step == 1 and torch.equal(loaded.state["w"], expected(1)["w"])


def test_a_rank_killed_before_it_said_hello_or_summed_its_snapshot_still_restores_it_verified(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # The process never reaches a saver and its checksum helper never runs: step 1 is sealed in
    # memory without its checksum table, and no saver saw the rank drop.
    child = CHILD_PRELUDE + textwrap.dedent(
        """
        from flashckpt_integrations.core import verify
        Checkpointer._connect_quietly = lambda self: None
        verify.Checksummer.schedule = lambda self, *args, **kwargs: None
        ck = Checkpointer(ckpt_dir)
        assert ck.save(1, state(1), persist=False).ok
        assert ck.wait_for_snapshot() is None
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = run_python(child, ckpt)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not os.path.exists(os.path.join(ckpt, "step-1"))
    # The relaunched rank's saver sums what the dead process left before it answers the hello.
    with Checkpointer(ckpt) as ck:
        loaded = ck.load()
        assert (loaded.step, loaded.source, loaded.fallbacks) == (1, "memory", [])
    assert torch.equal(loaded.state["w"], expected(1)["w"])


@pytest.mark.parametrize("window", ["write", "commit"])
def test_saver_and_trainer_killed_mid_persist_the_next_saver_finishes_it(tmp_path, window):
    # Every data file (and the tracker) waits 1 s before it is written: the kill lands mid-write,
    # or between the rank's done marker and the commit.
    ckpt = str(tmp_path / "ckpt")
    child = CHILD_PRELUDE + textwrap.dedent(
        """
        import time
        from tests.helpers import kill_savers
        ck = Checkpointer(ckpt_dir, storage_factory="tests.helpers:SlowStorage")
        ck.save(1, state(1), persist=True)
        marker = os.path.join(ckpt_dir, ".flashckpt", "steps", "1", "rank-0.a1.done")
        if sys.argv[2] == "write":
            while not os.path.exists(os.path.join(ck.run_dir, "saver.sock")):
                time.sleep(0.01)
            time.sleep(0.5)
        else:
            while not os.path.exists(marker):
                time.sleep(0.005)
        kill_savers(ck.run_dir)
        assert not os.path.exists(os.path.join(ckpt_dir, ".flashckpt", "steps", "1", "COMMITTED"))
        print("killed with marker" if os.path.exists(marker) else "killed before marker", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = run_python(child, ckpt, window, env={"FLASHCKPT_TEST_WRITE_DELAY": "1"})
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert out.stdout.strip() == ("killed before marker" if window == "write" else "killed with marker")
    with Checkpointer(ckpt) as ck:
        assert _wait_committed(ck, 1) == [1], open(os.path.join(ck.run_dir, "saver.log")).read()
        loaded = ck.load(prefer_memory=False)
        log = open(os.path.join(ck.run_dir, "saver.log")).read()
    for key, value in expected(1).items():
        assert torch.equal(torch.as_tensor(loaded.state[key]), torch.as_tensor(value))
    if window == "commit":
        assert "the commit of step 1 was interrupted; committing it now" in log


def test_a_commit_waiting_for_a_lost_rank_gives_way_once_the_job_is_relaunched(tmp_path):
    from flashckpt_integrations.core import saver

    ckpt = str(tmp_path / "ckpt")
    # Rank 0 of a 2-rank job persists step 1; rank 1 (on a node that is lost) never will.
    ck = Checkpointer(ckpt, rank=0, world_size=2)
    try:
        result = ck.save(1, expected(1))
        assert result.status is SaveStatus.PERSISTING
        markers = os.path.join(ckpt, ".flashckpt", "steps", "1")
        deadline = time.monotonic() + 30
        while not (os.path.isdir(markers) and any(n.endswith(".done") for n in os.listdir(markers))):
            assert time.monotonic() < deadline, "rank 0's files of step 1 were not written"
            time.sleep(0.05)
        # Its own files are durable: its slot takes the next saves while the commit waits.
        for step in (2, 3):
            assert ck.save(step, expected(step), persist=False).ok
        # The job is relaunched: a new process of rank 0 says hello to the same saver.
        child = CHILD_PRELUDE + textwrap.dedent(
            """
            ck = Checkpointer(ckpt_dir, rank=0, world_size=2)
            ck.client.connect()
            os._exit(0)
            """
        )
        proc = run_python(child, ckpt)
        assert proc.returncode == 0, proc.stderr
        outcome = result.wait(saver.SUPERSEDED_GRACE_S + 30)  # not commit_timeout_s (600 s)
        assert not outcome.committed and "relaunched" in (outcome.error or ""), outcome
        assert ck.committed_steps() == []  # its record says why: a loader never takes step-1/
        assert "relaunched" in read_json(ck.storage, ".flashckpt/steps/1/FAILED")["reason"]
    finally:
        ck.close(wait=False)
