"""Replication rounds and the trainer, on real slots: a round's copy of a trainer's slot never
keeps a save waiting."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from types import SimpleNamespace

import torch

from flashckpt_integrations.core.replication import store as store_module
from flashckpt_integrations.core.replication.rounds import Rounds
from flashckpt_integrations.core.replication.store import ReplicaStore
from flashckpt_integrations.core.shm_buffer import Slot


def test_a_save_that_needs_the_slot_a_round_copies_takes_it_at_once(make_checkpointer, private_shm_dir,
                                                                     monkeypatch):
    state = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB
    ck = make_checkpointer(busy_timeout_s=20.0)
    for step in (1, 2):
        assert ck.save(step, state, persist=False).ok
        assert ck.wait_for_snapshot() is None
    newest, other = ck.slots.newest_index(), 1 - ck.slots.newest_index()

    # The other slot is held as a persist holds it; a round copies the newest, slowly (small pieces).
    persist_fd = os.open(ck.slot_paths[other], os.O_RDWR)
    fcntl.flock(persist_fd, fcntl.LOCK_EX)
    real_chunks, pieces_copied = store_module.chunks, []

    def slow_chunks(start, end):
        for offset in range(start, end, 1 << 16):
            pieces_copied.append(offset)
            time.sleep(0.005)  # 512 pieces: 2.5 s at least for the whole copy
            yield offset, min(1 << 16, end - offset)

    monkeypatch.setattr(store_module, "chunks", slow_chunks)
    store = ReplicaStore(private_shm_dir, "roundjob")
    rounds = Rounds(SimpleNamespace(store=store), SimpleNamespace(node_rank=0))
    source = Slot.attach(ck.slot_paths[newest])
    copied: list[str | None] = []
    copier = threading.Thread(target=lambda: copied.append(rounds._copy_own(0, source, source.read_header())))
    try:
        copier.start()
        while len(pieces_copied) < 5:  # the copy holds the slot's lock now
            time.sleep(0.001)
        for tensor in state.values():
            tensor.add_(1)
        result = ck.save(3, state, persist=False)
        pieces_at_save = len(pieces_copied)
        copier.join(30)
    finally:
        monkeypatch.setattr(store_module, "chunks", real_chunks)
        fcntl.flock(persist_fd, fcntl.LOCK_UN)
        os.close(persist_fd)

    assert result.ok, f"the save waited for the round's copy until it gave up: {result}"
    assert pieces_at_save < 256, "the copy let go of the slot before it was half done"
    assert copied and copied[0] is not None and "needed" in copied[0], copied
    assert not [info for info in store.held(0) if info.step == 2], "the copy it gave up is not kept"
    assert ck.wait_for_snapshot() is None
    loaded = ck.load(target={k: torch.zeros_like(v) for k, v in state.items()})
    assert loaded.step == 3 and all(torch.equal(loaded.state[k], state[k]) for k in state), \
        "the save went into the slot the copy let go of, whole"
    source.close()
    store.close()


def test_a_round_holds_the_trainers_slot_for_the_copy_only_and_checksums_its_own(make_checkpointer,
                                                                               private_shm_dir, monkeypatch):
    state = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(8)}  # 8 MiB
    ck = make_checkpointer()
    assert ck.save(1, state, persist=False).ok
    assert ck.wait_for_snapshot() is None
    path = ck.slot_paths[ck.slots.newest_index()]

    inode = os.stat(path).st_ino

    def slot_locked() -> bool:
        """Whether this process holds an exclusive flock on the slot (/proc/locks: another
        process's shared probe, e.g. a saver's, does not count)."""
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if fields[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and fields[4] == str(os.getpid()) \
                        and int(fields[5].rsplit(":", 1)[1]) == inode:
                    return True
        return False

    real_crc32, locked_while_summing, copying = store_module.zlib.crc32, [], []
    real_chunks = store_module.chunks

    def watched_chunks(start, end):
        for piece in real_chunks(start, end):
            copying.append(slot_locked())
            yield piece

    def watched_crc32(data, value=0):
        locked_while_summing.append(slot_locked())
        return real_crc32(data, value)

    monkeypatch.setattr(store_module, "chunks", watched_chunks)
    monkeypatch.setattr(store_module.zlib, "crc32", watched_crc32)
    store = ReplicaStore(private_shm_dir, ck.job_key)
    rounds = Rounds(SimpleNamespace(store=store), SimpleNamespace(node_rank=0))
    source = Slot.attach(path)
    try:
        assert rounds._copy_own(0, source, source.read_header()) is None
    finally:
        monkeypatch.setattr(store_module.zlib, "crc32", real_crc32)
    held = [info for info in store.held(0) if info.step == 1]
    assert held, "the round's copy was not kept"
    assert any(copying[1:]), "the copy did not hold the trainer's slot while it read it"
    assert locked_while_summing and not any(locked_while_summing), \
        "the checksum pass held the trainer's slot: a save would wait for it"
    replica = store.acquire(0, 1, held[0].seq)
    try:
        _, crc, _ = store_module.read_record(replica)
        start, end = store_module.HEADER_SIZE, store_module.head_of(source.read_header())["nbytes"]
        with source.memoryview(start, end - start) as a, replica.memoryview(start, end - start) as b:
            assert crc == real_crc32(a), "the kept copy's crc32 is not that of the trainer's bytes"
            assert a == b
    finally:
        store.release(replica)
        source.close()
        store.close()


def test_rounds_pay_for_their_cpu_from_idle_time_and_never_less_than_the_cpu_share(monkeypatch, tmp_path):
    """A node whose CPUs wait (for GPUs) lets rounds take half its idle CPU time; a busy node, the
    fixed share of its CPUs; a container's quota caps what counts as idle."""
    from flashckpt_integrations._utils.cpus import IdleMeter
    from flashckpt_integrations.core.replication import pacing

    monkeypatch.delenv("FLASHCKPT_REPLICA_CPU", raising=False)
    monkeypatch.delenv("FLASHCKPT_REPLICA_IDLE", raising=False)
    assert pacing.cpu_allowance(8, None) == 0.08  # unknown idle time: 1% of 8 CPUs
    assert pacing.cpu_allowance(8, 0.0) == 0.08  # every CPU busy training
    assert pacing.cpu_allowance(8, 6.0) == 3.0  # six CPUs idle: half of them
    monkeypatch.setenv("FLASHCKPT_REPLICA_IDLE", "0.1")
    assert abs(pacing.cpu_allowance(8, 6.0) - 0.6) < 1e-9

    # A cgroup v2 quota of 1.5 CPUs, of which 1.0 CPU s/s are used: at most 0.5 CPUs are idle,
    # however idle the host's CPUs are.
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "cpu.stat").write_text("usage_usec 0\nuser_usec 0\n")
    meter = IdleMeter(str(tmp_path))
    started = time.monotonic()
    time.sleep(0.2)
    (tmp_path / "cpu.stat").write_text(f"usage_usec {int((time.monotonic() - started) * 1e6)}\nuser_usec 0\n")
    rate = meter.rate()
    assert rate is not None and rate <= 0.5 + 0.05, rate
    # Without a quota, the idle time of this process's CPUs (a sleeping test leaves most idle).
    (tmp_path / "cpu.max").write_text("max 100000\n")
    meter = IdleMeter(str(tmp_path))
    time.sleep(0.2)
    rate = meter.rate()
    assert rate is not None and 0 <= rate <= len(os.sched_getaffinity(0)) + 0.05, rate


def test_a_receive_cut_short_after_the_store_closed_gives_up_quietly(private_shm_dir):
    """A peer's copy still arriving when the job ends cleanly: the store is closed (its slots
    unmapped), then the receive fails and abandons its slot, which must not raise (it raised
    ``TypeError`` on the unmapped slot), and the closed store makes no new slot."""
    store = ReplicaStore(private_shm_dir, "closingjob")
    slot = store.begin(0, 1, 1, 0, 1 << 20)
    store.close()
    store.abandon(slot, 0)
    try:
        store.begin(0, 2, 2, 0, 1 << 20)
    except store_module.ReplicaSkipped as exc:
        assert "closed" in str(exc)
    else:
        raise AssertionError("a closed store made a new slot")
