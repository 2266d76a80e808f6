"""The commit protocol: how one save of a step becomes the one that loads.

A save is named by its save id (``sid``, one per attempt's save of a step, see
:mod:`.layout`). Call order for save ``sid`` of step N:

1. Each rank's writer (its node's saver, or the training process when it writes straight to
   storage): :func:`claim` says where to write (the step's own directory, or a staging directory
   when the layout stages or step N is committed already and its files must stay intact), then
   the files are written and ``write_rank_done`` publishes the rank's marker.
2. The committer (the saver of global rank 0): :func:`commit` waits for every rank's marker of
   ``sid``, then switches: one atomic write of the commit record makes ``sid`` the save that
   loads. Saving a committed step again therefore supersedes it: the old files load until that
   write, the new ones after it, never a mix. Then the new files move into the step's own
   directory (the old ones out of the way first), the record is rewritten to name that place,
   and what the old save left is removed. A crash anywhere leaves a record that names a
   complete save: :func:`~.layout.files_dir` resolves where its files are.
3. Readers: the commit record says which save counts; they read its markers (``sid``) and its
   files (``files_dir``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .._utils.faults import fault_point
from . import lineage
from .layout import (
    COMMITTED,
    FAILED,
    META_DIR,
    Layout,
    commit_record,
    commit_records,
    committed_steps,
    marker_name,
    now,
    read_json,
    write_json,
)
from .storage import Storage, write_bytes

logger = logging.getLogger(__name__)

COMMIT_POLL_S = 0.02


def settled(storage: Storage, step: int, sid: str, names: set[str] | None = None) -> tuple[str | None, dict[str, Any]]:
    """Whether save ``sid`` of ``step`` is decided: ``("committed", its commit record)``,
    ``("failed", its failure record)``, or ``(None, {})`` while neither is on storage.

    ``names`` is the listing of the step's marker directory when the caller has it.
    """
    marker_dir = Layout.marker_dir(step)
    names = set(storage.list(marker_dir)) if names is None else names
    if COMMITTED in names:
        record = commit_record(storage, step) or {}
        if record.get("sid", "") == sid:
            return "committed", record
    if FAILED in names:
        failure = read_json(storage, f"{marker_dir}/{FAILED}")
        if failure.get("sid", "") == sid:
            return "failed", failure
    return None, {}


def claim(storage: Storage, layout: Layout, request: dict[str, Any]) -> str:
    """Where rank ``request['rank']`` writes its files of save ``sid``; drops its own stale markers of that save."""
    rank, step, sid = int(request["rank"]), int(request["step"]), request.get("sid", "")
    names = set(storage.list(layout.marker_dir(step)))
    for name in (marker_name(rank, sid), marker_name(rank, sid, ok=False)):
        if name in names:
            storage.remove(f"{layout.marker_dir(step)}/{name}")
    supersede = COMMITTED in names
    if supersede:
        logger.info("step %d is committed already; save %s is staged and replaces it once every rank's files "
                    "are durable", step, sid or "-")
    return layout.write_path(step, sid, supersede=supersede)


def already_persisted(storage: Storage, layout: Layout, request: dict[str, Any], *, recovered: bool) -> bool:
    """This very snapshot's files are durable already (a recovered request met the original)."""
    rank, step, seq, sid = int(request["rank"]), int(request["step"]), int(request["seq"]), request.get("sid", "")
    names = set(storage.list(layout.marker_dir(step)))
    mine = marker_name(rank, sid)
    if mine in names and read_json(storage, f"{layout.marker_dir(step)}/{mine}").get("seq") == seq:
        logger.info("rank %d step %d (seq %d) was persisted already", rank, step, seq)
        return True
    if recovered and settled(storage, step, sid, names)[0] == "committed":
        logger.info("step %d is committed already; the recovered request of rank %d is dropped", step, rank)
        return True
    return False


def commit(storage: Storage, request: dict[str, Any], local_error: str | None = None, *,
           give_way: Callable[[], str | None] = lambda: None,
           serial: AbstractContextManager[Any] = contextlib.nullcontext()) -> bool:
    """Commit save ``request['sid']`` of its step once every rank's marker exists (the committer).

    ``local_error`` is rank 0's own persist failure: the step cannot commit, and its failed
    marker may not have reached storage, so do not wait. Returns whether a commit was written
    by this call; a failure writes the step's FAILED record (naming the save) and is logged, and
    raises when even that record cannot be written. ``give_way()`` is polled while the markers
    are awaited: a reason it returns fails the step at once. ``serial`` is held from the end of
    that wait to the end of the switch (commits wait side by side, switch one at a time).
    """
    step, world_size, sid = int(request["step"]), int(request["world_size"]), request.get("sid", "")
    layout = Layout(**request["layout"])
    marker_dir = layout.marker_dir(step)
    try:
        if local_error is not None:
            raise RuntimeError(f"ranks [0] failed to persist step {step}: {local_error}")
        if not storage.list(marker_dir) and any(s > step for s in committed_steps(storage)):
            logger.info("step %d was committed and retention has deleted it since", step)
            return False  # asked again (a recovered request met the rank's own): nothing left to commit
        _drop_stale_failure(storage, layout, step, sid)
        markers = _wait_for_markers(storage, layout, request, give_way)
        with serial:  # (another commit of the same save may have switched it in while this one waited)
            if markers is None or settled(storage, step, sid, set(storage.list(marker_dir)))[0] is not None:
                # committed or failed already (asked again); a switch may be unfinished
                finish_switch(storage, layout, step)
                return False
            fault_point("saver.commit")  # every rank's files are durable, nothing committed yet
            _switch(storage, layout, request, markers)
        logger.info("step %d committed (%d ranks)", step, world_size)
        return True
    except Exception as exc:
        logger.error("commit of step %d failed: %s", step, exc)
        try:
            write_json(storage, f"{marker_dir}/{FAILED}", {"step": step, "sid": sid, "reason": str(exc), "time": now()})
        except Exception as record_exc:  # nobody can read the failure from storage: the caller reports it
            raise RuntimeError(f"{exc} (and the failure could not be recorded on storage: {record_exc})") from exc
        return False


def _wait_for_markers(storage: Storage, layout: Layout, request: dict[str, Any],
                      give_way: Callable[[], str | None]) -> list[dict[str, Any]] | None:
    """Every rank's marker of the save; None when the save is committed or failed already."""
    step, world_size, sid = int(request["step"]), int(request["world_size"]), request.get("sid", "")
    marker_dir = layout.marker_dir(step)
    deadline = time.monotonic() + float(request.get("commit_timeout", 600))
    while True:
        names = set(storage.list(marker_dir))
        if settled(storage, step, sid, names)[0] is not None:
            return None
        failed = sorted(r for r in range(world_size) if marker_name(r, sid, ok=False) in names)
        missing = [r for r in range(world_size) if marker_name(r, sid) not in names]
        if failed:
            raise RuntimeError(f"ranks {failed} failed to persist step {step}")
        if not missing:
            return [read_json(storage, f"{marker_dir}/{marker_name(r, sid)}") for r in range(world_size)]
        reason = give_way()
        if reason is not None:
            raise RuntimeError(f"ranks {missing[:16]}{'...' if len(missing) > 16 else ''} did not persist step "
                               f"{step}: {reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {missing[:16]}{'...' if len(missing) > 16 else ''} did not persist step "
                f"{step} within {request.get('commit_timeout')}s"
            )
        time.sleep(COMMIT_POLL_S)


def _switch(storage: Storage, layout: Layout, request: dict[str, Any], markers: list[dict[str, Any]]) -> None:
    """Make save ``sid`` the one that loads, move its files into place, remove what it replaced."""
    step, sid = int(request["step"]), request.get("sid", "")
    final = layout.step_path(step)
    bases = {m.get("base") or layout.write_path(step) for m in markers}
    if len(bases) != 1:
        raise RuntimeError(f"the ranks wrote save {sid} of step {step} into different directories {sorted(bases)}; "
                           "not committed, so that no checkpoint mixes two saves")
    base = bases.pop()
    old = commit_record(storage, step)
    record = {
        "step": step, "world_size": int(request["world_size"]), "step_dir": final, "time": now(), "sid": sid,
        **(request.get("tag") or {}),
    }
    if base == final and old is not None and old.get("sid", "") != sid:
        raise RuntimeError(f"step {step} was committed by save {old.get('sid')} while save {sid} wrote into its "
                           "directory; not committed")
    trash, tracked = None, False
    if base != final:
        if old is None and not storage.exists(final):
            storage.rename(base, final)  # nothing to keep intact: the commit record below is the switch
        else:
            # The switch: from this write on, the new save is the one that loads (from where it is).
            write_json(storage, f"{layout.marker_dir(step)}/{COMMITTED}",
                       {**record, "files_dir": base, "final_dir": final, "replaces": (old or {}).get("sid")})
            _write_tracker(storage, layout, request, step)
            tracked = True
            try:
                fault_point("saver.supersede")  # switched, the new files not yet in place
                trash = _move_into_place(storage, base, final, step)
            except Exception as exc:  # committed all the same: the record names where the files are
                logger.error("step %d is committed, but its files stay in %s for now (the next commit of the "
                             "step's save moves them): %s", step, base, exc)
                return
        if sid:
            storage.remove(layout.staging_root(step, sid))  # this save's own staging folder, empty now
    if not tracked:
        _write_tracker(storage, layout, request, step)
    write_json(storage, f"{layout.marker_dir(step)}/{COMMITTED}", {**record, "files_dir": final})
    _remove_replaced(storage, layout, step, sid, trash)


def _move_into_place(storage: Storage, base: str, final: str, step: int) -> str | None:
    """Move the staged files to ``final``, the files there out of the way first; returns where those went."""
    trash = None
    if storage.exists(final):
        trash = f"{META_DIR}/trash/{step}-{uuid.uuid4().hex[:8]}"
        storage.rename(final, trash)
    storage.rename(base, final)
    return trash


def finish_switch(storage: Storage, layout: Layout, step: int) -> None:
    """Finish moving a superseding save into place after the committer died in the middle of it."""
    record = commit_record(storage, step)
    if not record or not record.get("final_dir") or record.get("files_dir") == record.get("final_dir"):
        return
    fault_point("saver.supersede")
    base, final = record["files_dir"], record["final_dir"]
    if storage.exists(base):
        _move_into_place(storage, base, final, step)
    write_json(storage, f"{layout.marker_dir(step)}/{COMMITTED}",
               {k: v for k, v in record.items() if k not in ("final_dir", "replaces")} | {"files_dir": final})
    _remove_replaced(storage, layout, step, record.get("sid", ""), None)
    logger.info("step %d: the superseding save %s is in place", step, record.get("sid"))


def _write_tracker(storage: Storage, layout: Layout, request: dict[str, Any], step: int) -> None:
    """The tracker names this step unless a newer commit (a later lineage, or a later step) exists."""
    if not layout.tracker:
        return
    mine = lineage.order_key(request.get("tag"), step)
    others = [lineage.order_key(rec, s) for s, rec in commit_records(storage).items() if s != step]
    if not others or max(others) < mine:
        write_bytes(storage, layout.tracker, layout.tracker_bytes(step))


def _remove_replaced(storage: Storage, layout: Layout, step: int, sid: str, trash: str | None) -> None:
    """Markers, failure records and files of the saves of ``step`` that ``sid`` replaced (best effort)."""
    marker_dir = layout.marker_dir(step)
    try:
        for name in storage.list(marker_dir):
            if name.startswith("rank-") and _marker_sid(name) != sid:
                storage.remove(f"{marker_dir}/{name}")
            elif name == FAILED:
                storage.remove(f"{marker_dir}/{name}")
        if trash is not None:
            storage.remove(trash)
        for name in storage.list(f"{META_DIR}/trash"):
            if name.startswith(f"{step}-"):
                storage.remove(f"{META_DIR}/trash/{name}")
    except Exception as exc:  # leftovers of an old save are harmless: the commit record ignores them
        logger.warning("could not remove what save %s of step %d replaced: %s", sid, step, exc)


def _marker_sid(name: str) -> str:
    """``rank-3.a2.done`` -> ``a2``; ``rank-3.done`` -> ``""``."""
    middle = name.removeprefix("rank-").rpartition(".")[0]
    return middle.partition(".")[2]


def _drop_stale_failure(storage: Storage, layout: Layout, step: int, sid: str) -> None:
    """A FAILED record of another save, or of this save but older than rank 0's new marker, is stale."""
    marker_dir = layout.marker_dir(step)
    if FAILED not in set(storage.list(marker_dir)):
        return
    failure = read_json(storage, f"{marker_dir}/{FAILED}")
    if failure.get("sid", "") != sid:
        return  # another save's failure: it does not stop this one (it is removed at this commit)
    rank0 = f"{marker_dir}/{marker_name(0, sid)}"
    if storage.exists(rank0) and read_json(storage, rank0).get("time", 0) > failure.get("time", 0):
        storage.remove(f"{marker_dir}/{FAILED}")
        logger.info("step %d is being saved again; its earlier failed attempt is forgotten", step)
