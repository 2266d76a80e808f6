"""Peer replicas, in one process: placement, settings, and which loads consult the peers at all."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashckpt_integrations import CheckpointerConfig
from flashckpt_integrations.core.replication import placement
from flashckpt_integrations.core.replication.rank import ReplicaHook, replica_count


def test_placement_is_the_next_nodes_in_ring_order():
    assert placement(0, 2, 1) == [1] and placement(1, 2, 1) == [0]
    assert placement(2, 4, 2) == [3, 0] and placement(3, 4, 2) == [0, 1]
    assert placement(1, 2, 2) == [0], "never the node itself, fewer when there are fewer others"
    assert placement(0, 1, 1) == []


def test_replica_count_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="replicas=3 must be 0"):
        CheckpointerConfig(replicas=3)
    assert replica_count(2) == 2
    monkeypatch.setenv("FLASHCKPT_REPLICAS", "1")
    assert replica_count(0) == 1
    monkeypatch.setenv("FLASHCKPT_REPLICAS", "yes")
    with pytest.raises(ValueError, match="FLASHCKPT_REPLICAS='yes' must be 0, 1 or 2"):
        replica_count(0)


class _Hook(ReplicaHook):
    """The hook of a one-rank job whose peers are faked: what it was asked, what it fetched."""

    def __init__(self, offers: dict[int, dict]) -> None:
        self.ck = SimpleNamespace(world_size=1, process_group=None, rank=0)
        self._snapshots = lambda: {**self.local, **dict.fromkeys(self.got, "fetched")}
        self.enabled, self.offers, self.local, self.got, self.asked = True, offers, {}, [], 0

    def _offers(self) -> dict[int, dict]:
        self.asked += 1
        return self.offers

    def _fetch(self, entry: dict) -> str | None:
        self.got.append(entry["step"])
        return None


def test_the_peers_are_asked_only_when_the_step_to_load_is_missing():
    hook = _Hook({5: {"step": 5}})
    hook.local = {4: "slot"}
    memory, common = hook.resolve(hook.local, [[[4], 3]], {4}, 3, None)
    assert (memory, common, hook.asked) == ({4: "slot"}, {4}, 0), "every rank holds the newest: no peer is asked"
    memory, common = hook.resolve(hook.local, [[[4], 6]], {4}, 6, None)
    assert hook.asked == 0, "a commit newer than any memory: storage, as before"

    hook.local = {}
    memory, common = hook.resolve({}, [[[], 3]], set(), 3, None)
    assert hook.asked == 0, "no rank holds anything: a fresh start or a whole job lost, no peer is asked"

    hook = _Hook({5: {"step": 5}, 2: {"step": 2}})
    hook.local = {4: "slot"}
    memory, common = hook.resolve(hook.local, [[[4], 3]], {4}, 3, 5)  # load(step=5): only a peer holds it
    assert hook.got == [5] and common == {5} and memory[5] == "fetched"
