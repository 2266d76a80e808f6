"""Data-parallel reuse for peer replicas (core/replication/reuse.py), on real slots: a replica is
assembled from the pieces the receiving node's own snapshot holds and the bytes sent for the
rest, and comes out byte for byte the sender's snapshot; pieces that only look alike are sent;
a sender's rank whose comparisons find nothing is compared less and less often."""

from __future__ import annotations

import os
import zlib

import torch

from flashckpt_integrations.core.replication.reuse import LocalCrcs, pieces, whole_crc
from flashckpt_integrations.core.shm_buffer import HEADER_SIZE, Slot


def _snapshot(ck, step, state):
    assert ck.save(step, state, persist=False).ok
    assert ck.wait_for_snapshot() is None  # a first save is sealed once its attempt is recorded
    slot = Slot.attach(ck.slot_paths[ck.slots.newest_index()])
    header = slot.read_header()
    return slot, header, header.meta_offset + header.meta_len


def test_a_replica_takes_the_identical_tensors_from_the_local_snapshot(make_checkpointer, tmp_path, private_shm_dir):
    torch.manual_seed(0)
    shared = {f"layer{i}": torch.randn(4096) for i in range(4)}  # what data-parallel ranks hold alike
    sender = make_checkpointer(tmp_path / "sender", node_id="sender")
    local = make_checkpointer(tmp_path / "local", node_id="local")
    source, header, end = _snapshot(sender, 7, {**shared, "rng": torch.randn(4096), "step": 7})
    mine, _, _ = _snapshot(local, 7, {**{k: v.clone() for k, v in shared.items()}, "rng": torch.randn(4096),
                                      "step": 7})
    parts = pieces(source, header, HEADER_SIZE, end)
    with source.memoryview(HEADER_SIZE, end - HEADER_SIZE) as view:
        expected = bytes(view)
    assert whole_crc(parts) == zlib.crc32(expected), "the crc of the whole copy, from its pieces"
    assert sum(p.length for p in parts) == end - HEADER_SIZE

    replica = Slot.create_or_open(os.path.join(private_shm_dir, "replica"), end)
    reused = LocalCrcs().reuse(replica, parts, [mine.path])
    reused_bytes = sum(parts[i].length for i in reused)
    assert reused_bytes == 4 * 4096 * 4, "the four shared tensors, and not the rng state of the same shape"
    for index, piece in enumerate(parts):  # what the sender streams
        if index not in reused:
            with source.memoryview(piece.offset, piece.length) as src, replica.memoryview(piece.offset,
                                                                                          piece.length) as dst:
                dst[:] = src
    with replica.memoryview(HEADER_SIZE, end - HEADER_SIZE) as view:
        assert bytes(view) == expected, "the replica is the sender's snapshot, byte for byte"

    other, _, _ = _snapshot(local, 8, {k: torch.randn(4096) for k in shared} | {"rng": torch.randn(4096),
                                                                                 "step": 8})
    assert LocalCrcs().reuse(replica, parts, [other.path]) == set(), "same shapes, other values: all sent"

    # Comparisons that find nothing are made less and less often; one that reuses starts again.
    crcs, source_rank = LocalCrcs(), (1, 3)
    compared = []
    for copy in range(12):
        if crcs.worth_comparing(*source_rank):
            compared.append(copy)
            assert crcs.reuse(replica, parts, [other.path], source=source_rank) == set()
    assert compared == [0, 2, 5, 10], "after each miss, 1, 2, 4 ... copies go whole uncompared"
    assert crcs.worth_comparing(0, 3), "another sender's rank is compared as before"
    while not crcs.worth_comparing(*source_rank):
        pass
    assert crcs.reuse(replica, parts, [mine.path], source=source_rank), "shared tensors found again"
    assert all(crcs.worth_comparing(*source_rank) for _ in range(3)), "a reuse starts the count again"
    for slot in (source, mine, other, replica):
        slot.close()
