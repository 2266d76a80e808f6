"""Fault campaign for verified restores: seeded faults in memory snapshots and committed files of a
2-rank job, each followed by a restart; every restore is compared with what was saved.

Each trial: both ranks (gloo, two processes) open a Checkpointer, commit steps ``a`` and ``a+1``
(the slots then hold ``a+1`` and a memory-only snapshot of ``a+2``), and then crash (the ``with`` block raises:
slots and saver stay, as after a crash). One seeded fault is injected (below), a new Checkpointer
on each rank restores into zeroed live tensors, and the restored state is compared, bit for bit,
with the state that was saved at the step ``load()`` reports. Counted: wrong restores (must be 0),
the step against the newest step that had a good copy on every rank, and which tier served. "A
newer one" happens only with ``no-checksums``: the fault erased a table before the node's saver
had handled the crashed rank's disconnection, and the saver, which sums what a dead rank left
unsummed, summed it again (the bytes were intact: such a restore is verified and right).

Faults: a flipped byte in a slot's tensor region or its pickle, in one or both slots of a rank;
a torn copy (a slot left in the writing state); a snapshot whose checksums were never written (the
process died right after the seal); a rank's node that lost its memory, with the peer's replica of
its newest snapshot intact or with a flipped bit (each rank is a node of its own: its own
shared-memory directory, node id and saver, ``replicas=1``, each snapshot pushed to the peer); a
flipped byte in, or a truncation of, a committed file with the job's memory gone (the restore must
come from storage: the older commit); a slot rewritten under the tensors a ``load()`` without a
target returned; and a stale slot of an earlier attempt (the job restarted from scratch, saved a
lower step and crashed: the old attempt's newer step is still in the other slot and must not be
restored).

    python benchmarks/campaign_verify.py --trials 1000 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

FAULTS = ("slot-region", "slot-blob", "both-slots", "torn", "no-checksums", "storage-flip", "storage-truncate",
          "live-view", "stale-attempt", "replica-flip", "replica-good")
REPLICA_FAULTS = ("replica-flip", "replica-good")


class _Crash(Exception):
    pass


def state(step: int, rank: int, attempt: int = 0) -> dict:
    g = torch.Generator().manual_seed(step * 1000 + rank + 500 * attempt)
    return {"w": torch.randn(128, 512, generator=g), "b": torch.randn(77, generator=g), "step": step}


def _shm(rank: int) -> str:
    """Each rank is a node of its own: its own shared-memory directory, node id and saver."""
    return os.path.join(os.environ["CAMPAIGN_SHM_ROOT"], f"node{rank}")


def _replica(rank: int, step: int) -> str | None:
    """The replica of ``rank``'s snapshot of ``step`` that the other node holds."""
    from flashckpt_integrations.core.client import job_key
    from flashckpt_integrations.core.replication import list_replicas

    found = [r.path for r in list_replicas(_shm(1 - rank), job_key("campaign")) if r.rank == rank and r.step == step]
    return found[0] if found else None


def _slots(ck_url: str, rank: int) -> dict[int, str]:
    """``{step: path}`` of ``rank``'s complete snapshots."""
    from flashckpt_integrations.core.client import job_key
    from flashckpt_integrations.core.shm_buffer import attach_complete

    prefix = f"flashckpt-{os.getuid()}-{job_key('campaign')}-r{rank}-"
    found = {}
    for name in os.listdir(_shm(rank)):
        attached = attach_complete(os.path.join(_shm(rank), name)) if name.startswith(prefix) else None
        if attached is not None:
            found[attached[1].step] = attached[0].path
            attached[0].close()
    return found


def _poke(path: str, what: str, rng: random.Random) -> None:
    from flashckpt_integrations.core.shm_buffer import Slot

    slot = Slot.attach(path)
    try:
        header = slot.read_header()
        meta = slot.read_metadata(header)
        if what == "torn":
            slot.begin_write(header.step, header.seq)  # the state a crash mid-copy leaves
            return
        if what == "no-checksums":
            slot.write_blob(int(meta["checksums"]["offset"]), b"\0" * 8)
            return
        if what == "blob":
            offset, nbytes = meta["files"][0]["blob"]
        else:
            offset, nbytes = rng.choice(meta["regions"])
        slot.buffer[offset + rng.randrange(nbytes)] ^= 1 << rng.randrange(8)
    finally:
        slot.close()


def inject(kind: str, url: str, steps: tuple[int, int, int], rng: random.Random) -> dict:
    """Apply one fault; return the step every rank still holds a good copy of (the best restore)."""
    first, older, newer = steps  # committed: first and older; older and newer in the slots
    rank = rng.randrange(2)
    slots = _slots(url, rank)
    good = newer
    if kind in ("slot-region", "slot-blob", "torn", "no-checksums"):
        step = rng.choice([older, newer])
        _poke(slots[step], {"slot-region": "region", "slot-blob": "blob"}.get(kind, kind), rng)
        good = older if step == newer else newer
    elif kind == "both-slots":
        for step in (older, newer):
            _poke(slots[step], "region", rng)
        good = older  # from storage
    elif kind in REPLICA_FAULTS:  # the rank's node lost its memory; the peer's replica is flipped, or intact
        for path in slots.values():
            os.unlink(path)
        if kind == "replica-flip":
            _poke(_replica(rank, newer), "region", rng)
            good = older  # from storage
    elif kind in ("storage-flip", "storage-truncate"):  # and the memory is gone (the node was replaced)
        for r in (0, 1):
            for path in _slots(url, r).values():
                os.unlink(path)
        good = first  # the older commit of this attempt
        path = os.path.join(url, f"step-{older}", f"rank-{rank}.pt")
        with open(path, "r+b") as f:
            size = f.seek(0, 2)
            if kind == "storage-truncate":
                f.truncate(rng.randrange(size))
            else:
                at = rng.randrange(size)
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    return {"rank": rank, "good": good}


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="1", FLASHCKPT_NODE_ID=f"node{rank}", FLASHCKPT_SHM_DIR=_shm(rank),
                      FLASHCKPT_REPLICA_ROUNDS="0")  # each sealed snapshot offered to the peer at once
    torch.set_num_threads(1)
    if args.log:
        import logging

        logging.basicConfig(level=logging.DEBUG if os.environ.get("CAMPAIGN_DEBUG") else logging.INFO,
                            format=f"[node {rank}] %(name)s: %(message)s")
    faults = tuple(args.faults.split(","))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from flashckpt_integrations import Checkpointer

    url = args.dir
    rng = random.Random(args.seed)  # the same draws on both ranks; rank 0 alone acts on them
    results = []
    for trial in range(args.trials):
        kind = faults[trial % len(faults)] if args.cycle else rng.choice(faults)
        base = 3 * trial + 1
        steps = (base, base + 1, base + 2)
        try:
            with Checkpointer(url, job_id="campaign", retention={"keep_last": 2}, commit_timeout_s=60,
                              replicas=1) as ck:
                ck.save(base, state(base, rank)).wait()
                ck.save(base + 1, state(base + 1, rank)).wait()
                ck.save(base + 2, state(base + 2, rank), persist=False)
                ck.wait_for_snapshot()
                ck.check_memory(base + 2)  # (collective) both ranks' checksums are written
                deadline = time.monotonic() + 30
                while kind in REPLICA_FAULTS and _replica(rank, base + 2) is None and time.monotonic() < deadline:
                    time.sleep(0.02)  # the peer holds this rank's newest snapshot
                raise _Crash
        except _Crash:
            pass
        dist.barrier()
        draw = random.Random(rng.random())  # drawn on both ranks: their sequences stay the same
        fault = inject(kind, url, steps, draw) if rank == 0 else None
        fault = [fault]
        dist.broadcast_object_list(fault, src=0)
        fault = fault[0]
        dist.barrier()
        attempt = 0
        if kind == "stale-attempt":  # the job is started again from scratch: a new attempt saves a lower
            attempt = 1  # step than the snapshots the old attempt left in the other slot, then crashes
            try:
                with Checkpointer(url, job_id="campaign", retention={"keep_last": 2}, commit_timeout_s=60,
                                  replicas=1) as ck:
                    ck.start_attempt(None)
                    ck.save(base + 1, state(base + 1, rank, attempt), persist=False)
                    ck.check_memory(base + 1)
                    raise _Crash
            except _Crash:
                pass
            fault["good"] = base + 1
            dist.barrier()
        if kind in REPLICA_FAULTS:  # a relaunch takes longer than the savers cache what their peers hold
            from flashckpt_integrations.core.replication import SURVEY_CACHE_S

            time.sleep(SURVEY_CACHE_S)
        started = time.perf_counter()
        row = {"trial": trial, "kind": kind, "good": fault["good"], "faulty_rank": fault["rank"]}
        try:
            with Checkpointer(url, job_id="campaign", retention={"keep_last": 2}, commit_timeout_s=60,
                              replicas=1) as ck:
                if kind == "live-view":
                    loaded = ck.load()
                    slot_path = _slots(url, rank)[loaded.step]
                    _poke(slot_path, "region", random.Random(trial))  # a stray write after load()
                    live = loaded.state
                else:
                    live = {"w": torch.zeros(128, 512), "b": torch.zeros(77), "step": -1}
                    loaded = ck.load(target=live)
                expected = state(loaded.step, rank, attempt)
                row.update(step=loaded.step, tier=loaded.tiers.get(rank), fallbacks=len(loaded.fallbacks),
                           equal=all(torch.equal(live[k], expected[k]) for k in ("w", "b"))
                           and loaded.state["step"] == loaded.step)
                raise _Crash
        except _Crash:
            pass
        except Exception as exc:  # a clear error is allowed only where no verified copy was left
            row.update(step=None, tier=None, error=f"{type(exc).__name__}: {exc}"[:300], equal=None)
        row["seconds"] = time.perf_counter() - started
        results.append(row)
        dist.barrier()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cycle", action="store_true", help="take the faults in turn instead of at random")
    parser.add_argument("--faults", default=",".join(FAULTS), help="the faults to draw from (comma-separated)")
    parser.add_argument("--log", action="store_true", help="the library's INFO log of every rank to stderr")
    parser.add_argument("--json", help="write every trial's row here")
    args = parser.parse_args()
    import socket

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        os.environ["CAMPAIGN_SHM_ROOT"] = os.path.join(tmp, "shm")
        for rank in (0, 1):
            os.makedirs(_shm(rank), mode=0o700)
        args.dir = os.path.join(tmp, "ckpt")
        started = time.perf_counter()
        mp.spawn(worker, args=(args, port, tmp), nprocs=2, join=True)
        rows = [json.load(open(os.path.join(tmp, f"rank-{r}.json"))) for r in range(2)]
        elapsed = time.perf_counter() - started
    report(rows, args, elapsed)


def report(rows: list[list[dict]], args: argparse.Namespace, elapsed: float) -> None:
    wrong = sum(1 for r in rows for t in r if t["equal"] is False)
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t0, t1 in zip(*rows):
        c = by_kind[t0["kind"]]
        c["trials"] += 1
        c["wrong"] += (t0["equal"] is False) + (t1["equal"] is False)
        if t0["step"] is None:
            c["error"] += 1
            continue
        c["best"] += t0["step"] == t0["good"]
        c["older"] += t0["good"] is not None and t0["step"] < t0["good"]
        c["newer"] += t0["good"] is not None and t0["step"] > t0["good"]
        for t in (t0, t1):
            c[f"tier:{t['tier']}"] += 1
            c["tier:memory"] += t["tier"] == "replica"
        c["fallbacks"] += t0["fallbacks"]
    print(f"{sum(len(r) for r in rows) // 2} trials on 2 ranks (seed {args.seed}) in {elapsed:.0f} s; "
          f"restores that differ from what was saved: {wrong}")
    print("| fault | trials | wrong restores | restored the newest good step | an older one | a newer one | "
          "clear error | fallbacks | ranks served from memory / storage |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in FAULTS:
        c = by_kind.get(kind)
        if not c:
            continue
        print(f"| {kind} | {c['trials']} | {c['wrong']} | {c['best']} | {c['older']} | {c['newer']} | {c['error']} | "
              f"{c['fallbacks']} | {c['tier:memory']} / {c['tier:storage']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
