"""Replication rounds: one step of every rank kept in memory, on its own node and on its peers.

Copying each rank's newest snapshot whenever a peer can take it leaves, after a node is lost, no
step that every rank still holds: by the time the lost node's replicas arrived the survivors'
slots have moved on, and the replicas of its ranks are of different steps. A round fixes one
step for the whole job. Every saver copies its ranks' snapshots of that step into its own
replica store (the node's kept copy: one memory copy) and from there to its peers; once every
node has done both, the step is the job's kept step, which no later copy overwrites until a
newer round is kept. A lost node then always leaves the kept step on every rank: the survivors'
own copies and the lost node's replicas, and ``load`` resumes there (the newest step every rank
holds, with or without rounds). The trainers take no part: a round reads their sealed slots as
a peer copy does, holding a slot's lock only while it copies it into the store.

Call order:

1. :class:`Rounds` is the default :class:`~.policy.CopyPolicy`, made by :func:`.service.copy_policy`
   when replication starts; :meth:`Rounds.start` starts the leader thread on node 0's saver.
2. The leader (:meth:`Rounds._lead`), once every rank of its node has sealed a step newer than the
   kept one; ``after`` = the kept step + 1 (0 before the first round). The next round waits until
   the sends took at most ``duty`` of the time (:func:`.pacing.copy_duty`) and every node's CPU
   time on the round is paid for at the rate that node allows (:func:`.pacing.cpu_allowance`: a
   share of its CPUs, or of the CPU time they were idle, which a node waiting for its GPUs has
   plenty of: there rounds follow each other within a second or two).
   - ``round_held`` asks every node's saver (its own directly, the others on the peer channel)
     which steps >= ``after`` all its ranks hold, and which of them are being persisted
     (:meth:`Rounds.held`; each node makes its store's slots for the copies meanwhile). The
     leader takes the newest step every node holds that is being persisted (its slots stay
     locked while the savers write them), else the newest every node holds (:func:`_steadiest`).
   - ``round_snap`` asks every node to copy its ranks' snapshots of that step into its store
     (:meth:`Rounds.snap`: each slot's lock held for one memory copy). When a save took a slot
     back meanwhile, the round starts again from a newer step (at most ``RETRIES`` times).
   - ``round_send``: every node copies those copies to its placement targets (:meth:`Rounds.send`).
   - When every node answered ok, ``round_kept`` gives every node the new kept step
     (:meth:`Rounds.keep`; each ``round_held`` and ``round_snap`` carries it as well).
   Each node serves these questions in :meth:`Rounds.handle` (the ops of
   :data:`~flashckpt_integrations.core.protocol.ROUND_OPS`, from :class:`~.server.PeerServer`).
3. Every store write asks :meth:`Rounds.kept` for the step :meth:`.ReplicaStore.begin` must not
   overwrite (the receiver of a peer's copy, and :meth:`Rounds.snap`).
4. :meth:`Rounds.close`.

Memory: a rank's kept copies live in its own node's store, two of them (the kept step and the
round in flight), beside the two replicas of each peer rank the node holds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..._utils.cpus import IdleMeter, affinity_cpus
from .. import verify
from ..protocol import ROUND_OPS, PeerOp
from ..shm_buffer import Slot, SlotHeader
from .local import local_slots, open_complete
from .pacing import copy_duty, cpu_allowance
from .peers import Channel, PeerRecord
from .policy import PolicyContext, ReplicaSettings
from .store import ReplicaSkipped, head_of
from .transfer import SEND_TIMEOUT_S, push_copy

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""How often the leader looks for a newer step while no round is due."""
RETRIES = 3
"""Rounds started again at once when a save took a slot back from a node's copy."""


def _steadiest(steps: list[int], persisting: set[int]) -> int:
    """Of ``steps`` (held by every rank of every node), the one a slow copy most likely reads to
    the end: the newest being persisted (its slots are locked while the savers write them, and
    every node persists the same steps), else the newest (the trainers write their next saves
    into the other slots)."""
    return max(persisting & set(steps) or steps)


class Rounds:
    """The rounds of one saver (see the module docstring): a :class:`~.policy.CopyPolicy`."""

    wants_pushes = False
    """The ranks offer no sealed snapshot: a round copies the steps it keeps itself."""

    def __init__(self, context: PolicyContext, settings: ReplicaSettings) -> None:
        self.context = context
        self.settings = settings
        self._kept: int | None = None
        self._lock = threading.Lock()  # one round at a time on this node
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_s = 1.0
        self._tally = {"kept": 0, "not_kept": 0}  # the leader's rounds
        self._spent: dict[int, float] = {}  # CPU seconds each node spent on the round in progress
        self._allowed: dict[int, float] = {}  # the CPU seconds per second each node lets rounds take
        self._sent_s = 0.0  # the longest send of the round in progress
        self._idle = IdleMeter()

    def start(self) -> None:
        """Start the leader on node 0's saver (a job of one node has no round)."""
        if self.settings.node_rank == 0 and self.settings.nnodes > 1:
            self._thread = threading.Thread(target=self._lead, name="replica-rounds", daemon=True)
            self._thread.start()

    def retarget(self, settings: ReplicaSettings) -> None:
        self.settings = settings

    def offer(self, note: dict[str, Any]) -> None:
        """Nothing: a round reads the ranks' sealed slots itself, when it is due."""

    def handles(self, op: str) -> bool:
        return op in ROUND_OPS

    def kept(self) -> int | None:
        """The job's kept step (None before the first kept round)."""
        return self._kept

    def close(self) -> None:
        self._stop.set()

    # --- every node ------------------------------------------------------------------------

    def _held(self) -> dict[int, dict[int, tuple[Slot, SlotHeader]]]:
        """Each rank of this node: its complete slots by step (the caller closes them)."""
        held: dict[int, dict[int, tuple[Slot, SlotHeader]]] = {}
        for rank, paths in local_slots(self.context.run_dir).items():
            held[rank] = {}
            for path in paths:
                found = open_complete(path)
                if found is not None and found[1].step in held[rank]:
                    found[0].close()  # the same step twice (a held slot): one copy is enough
                elif found is not None:
                    held[rank][found[1].step] = found
        return held

    @staticmethod
    def _close(held: dict[int, dict[int, tuple[Slot, SlotHeader]]]) -> None:
        for by_step in held.values():
            for slot, _ in by_step.values():
                slot.close()

    def held(self, message: dict[str, Any]) -> dict[str, Any]:
        """The steps >= ``after`` that every rank of this node holds, and those of them being
        persisted; the store's slots for the copies are made meanwhile (so that the copy that
        follows holds a trainer's slot for its memory copy only)."""
        if message.get("kept") is not None:
            self.keep({"step": message["kept"]})
        after = int(message["after"])
        cpu = time.thread_time()
        with self._lock:
            held = self._held()
            try:  # the store's slots first: making one takes a while, and the steps held move on
                for rank, by_step in held.items():
                    if by_step:
                        nbytes = head_of(max(by_step.values(), key=lambda f: f[1].step)[1])["nbytes"]
                        with contextlib.suppress(ReplicaSkipped):  # said again by the copy, if it still holds
                            self.context.store.prepare(rank, nbytes, keep=self._kept)
            finally:
                self._close(held)
            held = self._held()
            try:
                if not held:
                    return {"ok": False, "error": "no rank of this node has a slot yet"}
                common = set.intersection(*(set(s) for s in held.values()))
                steps = sorted(s for s in common if s >= after)
                persisting = [s for s in steps if all(by_step[s][1].persist_req == by_step[s][1].seq
                                                      for by_step in held.values())]
            finally:
                self._close(held)
        return {"ok": True, "steps": steps, "persisting": persisting, "cpu_s": time.thread_time() - cpu,
                "cpu_rate": cpu_allowance(affinity_cpus(), self._idle.rate())}

    def snap(self, message: dict[str, Any]) -> dict[str, Any]:
        """Copy this node's ranks' snapshots of ``step`` into the store."""
        if message.get("kept") is not None:
            self.keep({"step": message["kept"]})
        step = int(message["step"])
        started, cpu = time.monotonic(), time.thread_time()
        with self._lock:
            held = self._held()
            try:
                if not held:
                    return {"ok": False, "error": "no rank of this node has a slot yet"}
                missing = sorted(rank for rank, by_step in held.items() if step not in by_step)
                if missing:
                    return {"ok": False, "error": f"rank(s) {missing} of this node no longer hold step {step}",
                            "cpu_s": time.thread_time() - cpu}
                for rank, by_step in held.items():
                    slot, header = by_step[step]
                    error = self._copy_own(rank, slot, header)
                    if error is not None:
                        return {"ok": False, "error": error, "cpu_s": time.thread_time() - cpu}
            finally:
                self._close(held)
        return {"ok": True, "step": step, "ranks": sorted(held), "seconds": time.monotonic() - started,
                "cpu_s": time.thread_time() - cpu}

    def _copy_own(self, rank: int, slot: Slot, header: SlotHeader) -> str | None:
        """Copy one slot into the store, holding its lock (no save writes a locked slot) from the
        first piece that finds it free (a persist may hold it at first) until its bytes are
        copied. A save that finds no other slot free raises the slot's ``wanted``, and the copy
        lets go at once (it is dropped)."""
        if not verify.await_table(slot, header, verify.TABLE_WAIT_S):  # a copy without it is never restored
            return f"rank {rank}'s snapshot of step {header.step} has no checksums yet"
        locked = [False]
        asked = slot.wanted()

        def give_way() -> bool:
            if not locked[0]:
                locked[0] = slot.try_lock()
            return locked[0] and slot.wanted() != asked

        def let_go() -> None:
            if locked[0]:
                locked[0] = False
                slot.unlock()

        try:
            if not self.context.store.copy_local(rank, slot, header, self.settings.node_rank, keep=self._kept,
                                               give_way=give_way, let_go=let_go):
                return f"rank {rank}'s snapshot of step {header.step} was overwritten or needed while it was copied"
        except ReplicaSkipped as exc:
            return f"rank {rank}'s kept copy was not taken: {exc}"
        finally:
            let_go()
        return None

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        """Copy this node's kept copies of ``step`` to every placement target; ok once all hold them."""
        step = int(message["step"])
        ranks = sorted(local_slots(self.context.run_dir))
        errors: list[str] = []
        started, cpu = time.monotonic(), time.thread_time()
        with self._lock:
            for node in self.settings.targets():
                errors += self._send_to(node, ranks, step)
        spent = {"cpu_s": time.thread_time() - cpu, "seconds": time.monotonic() - started}
        return {"ok": False, "error": "; ".join(errors), **spent} if errors else {"ok": True, **spent}

    def _send_to(self, node: int, ranks: list[int], step: int) -> list[str]:
        store = self.context.store
        opened: list[Channel] = []

        def connect() -> Channel:
            if not opened:
                opened.append(self.context.dialer.connect_node(node, timeout=SEND_TIMEOUT_S))
            return opened[0]

        errors = []
        try:
            for rank in ranks:
                info = next((i for i in store.held(rank) if i.step == step), None)
                slot = store.acquire(rank, step, info.seq) if info is not None else None
                if slot is None:
                    errors.append(f"rank {rank} has no kept copy of step {step}")
                    continue
                try:
                    outcome = push_copy(self.context.status, node, connect, slot,
                                        {"rank": rank, "slot": slot.path, "step": step, "seq": info.seq},
                                        crc=info.data_crc)  # acquired: sealed and unchanging while sent
                finally:
                    store.release(slot)
                if outcome not in ("ok", "held"):
                    errors.append(f"rank {rank} to node {node}: {outcome}")
        except Exception as exc:  # unreachable, refused, gone mid-copy: the round fails
            errors.append(f"node {node}: {type(exc).__name__}: {exc}")
        finally:
            for channel in opened:
                channel.close()
        return errors

    def keep(self, message: dict[str, Any]) -> dict[str, Any]:
        """The job's kept step: no store write overwrites its copies until a newer one is kept."""
        step = int(message["step"])
        if step != self._kept:
            self._kept = step
            self.context.status.update(kept={"step": step, "time": round(time.time(), 3)})
        return {"ok": True}

    # --- the leader (node 0) ---------------------------------------------------------------

    def _lead(self) -> None:
        duty = copy_duty()
        next_at = 0.0
        while not self._stop.wait(POLL_S if time.monotonic() >= next_at else next_at - time.monotonic()):
            try:
                newest = self._newest_local()
                if newest is None or (self._kept is not None and newest <= self._kept):
                    continue
                started, self._spent, self._allowed, self._sent_s = time.monotonic(), {}, {}, 0.0
                kept = self._round(0 if self._kept is None else self._kept + 1)
                elapsed = time.monotonic() - started
                self._last_s = elapsed
                # Each node's CPU time on a round, kept or not, is paid for at the rate it allows
                # (:func:`.pacing.cpu_allowance`: a share of its CPUs, or of their idle time); a kept
                # round's sends to peers take at most ``duty`` of the time as well (a failed round,
                # often waiting at low priority, held nothing meanwhile).
                floor = cpu_allowance(affinity_cpus(), None)
                paid = max((spent / self._allowed.get(node, floor) for node, spent in self._spent.items()),
                           default=0.0)
                pause = max(self._sent_s * (1 / duty - 1), paid) if kept is not None else max(1.0, paid)
                next_at = time.monotonic() + pause
                logger.debug("replication round %s in %.2fs (sends %.2fs); CPU s per node %s at %s CPU s/s; the "
                             "next in %.1fs", "not kept" if kept is None else f"kept step {kept}", elapsed,
                             self._sent_s, {n: round(c, 3) for n, c in self._spent.items()},
                             {n: round(r, 2) for n, r in self._allowed.items()}, pause)
                self._tally["kept" if kept is not None else "not_kept"] += 1
                self.context.status.update(rounds=dict(self._tally))
            except Exception as exc:  # a round that cannot run is tried again later
                logger.warning("replication round failed: %s: %s", type(exc).__name__, exc)
                next_at = time.monotonic() + 1.0

    def _newest_local(self) -> int | None:
        """The newest step every rank of this node has sealed."""
        newest = []
        for paths in local_slots(self.context.run_dir).values():
            steps = []
            for path in paths:
                found = open_complete(path)
                if found is not None:
                    steps.append(found[1].step)
                    found[0].close()
            if not steps:
                return None
            newest.append(max(steps))
        return min(newest) if newest else None

    def _round(self, after: int) -> int | None:
        """One round from ``after``; the step it kept, or None."""
        settings = self.settings
        records = self.context.dialer.records()
        nodes = list(range(settings.nnodes))
        if any(n not in records for n in nodes if n != settings.node_rank):
            logger.debug("replication round: nodes %s have published no saver yet", sorted(set(nodes) - set(records)))
            return None
        for _ in range(RETRIES):
            answers = self._ask_all(records, nodes, {"op": PeerOp.ROUND_HELD, "after": after, "kept": self._kept})
            self._spend(answers)
            if not all(a.get("ok") for a in answers.values()):
                logger.debug("replication round from step %d: %s", after, answers)
                return None
            common = set.intersection(*(set(a["steps"]) for a in answers.values()))
            if not common:  # the nodes answered a save apart (asked again), or none holds a newer step
                if all(a["steps"] for a in answers.values()):
                    continue
                logger.debug("replication round from step %d: no step every node holds: %s", after, answers)
                return None
            step = _steadiest(sorted(common), set.intersection(*(set(a["persisting"]) for a in answers.values())))
            answers = self._ask_all(records, nodes, {"op": PeerOp.ROUND_SNAP, "step": step, "kept": self._kept})
            self._spend(answers)
            if all(a.get("ok") for a in answers.values()):
                break
            after = step + 1  # a save took a slot back: again, from a newer step
        else:
            logger.debug("replication round from step %d: no step every node holds, or its copies failed, %d "
                         "times: %s", after, RETRIES, answers)
            return None
        answers = self._ask_all(records, nodes, {"op": PeerOp.ROUND_SEND, "step": step})
        self._spend(answers, 2.0, sends=True)  # what each node's peers spent receiving it: about as much
        failed = {n: a.get("error") for n, a in answers.items() if not a.get("ok")}
        if failed:
            logger.info("replication round of step %d is not kept: %s", step, failed)
            return None
        self._ask_all(records, nodes, {"op": PeerOp.ROUND_KEPT, "step": step})
        logger.debug("step %d is kept in memory on every node", step)
        return step

    def _spend(self, answers: dict[int, dict[str, Any]], factor: float = 1.0, sends: bool = False) -> None:
        """Add what each node's answer says it spent (CPU ``factor`` times), the CPU rate it allows
        and, for ``sends``, how long its sends took."""
        for node, answer in answers.items():
            spent, rate, seconds = answer.get("cpu_s"), answer.get("cpu_rate"), answer.get("seconds")
            if isinstance(spent, (int, float)):
                self._spent[node] = self._spent.get(node, 0.0) + factor * spent
            if isinstance(rate, (int, float)) and rate > 0:
                self._allowed[node] = float(rate)
            if sends and isinstance(seconds, (int, float)):
                self._sent_s = max(self._sent_s, float(seconds))

    def _ask_all(self, records: dict[int, PeerRecord], nodes: list[int],
                 message: dict[str, Any]) -> dict[int, dict[str, Any]]:
        with ThreadPoolExecutor(len(nodes), thread_name_prefix="replica-round") as pool:
            futures = {n: pool.submit(self._ask, records.get(n), n, message) for n in nodes}
            return {n: f.result() for n, f in futures.items()}

    def _ask(self, record: PeerRecord | None, node: int, message: dict[str, Any]) -> dict[str, Any]:
        try:
            if node == self.settings.node_rank:
                return self.handle(message)
            channel = self.context.dialer.connect(record, timeout=max(60.0, 10 * self._last_s))
            with contextlib.closing(channel):
                channel.send(message)
                return channel.recv()
        except Exception as exc:
            return {"ok": False, "error": f"node {node}: {type(exc).__name__}: {exc}"}

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """Serve one round op (from the leader, on the peer channel or in this process)."""
        op = message.get("op")
        work = {PeerOp.ROUND_HELD: self.held, PeerOp.ROUND_SNAP: self.snap, PeerOp.ROUND_SEND: self.send,
                PeerOp.ROUND_KEPT: self.keep}.get(op)
        if work is None:
            return {"ok": False, "error": f"unknown op {op!r}"}
        try:
            return work(message)
        except Exception as exc:
            logger.warning("%s failed: %s: %s", op, type(exc).__name__, exc)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
