"""``Checkpointer``: the API every adapter (and plain PyTorch/DDP code) calls, composed of the
parts in this package (see its ``__init__`` for the call order)."""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import torch

from ... import knobs
from ...config import CheckpointerConfig
from ...errors import FlashCkptError
from .. import collectives, lineage, stop_notice, verify
from ..client import SaverClient, job_id_for, job_key, run_dir_for
from ..layout import Layout
from ..replication.rank import ReplicaHook
from ..results import LoadResult, PersistResult, SaveResult, SaveStatus
from ..shm_buffer import Slot
from ..state import Codec, normalize_files
from ..storage import storage_from_url
from .attempt import Attempt
from .loading import LoadPath
from .requests import ERROR_EXIT_WAIT_S, PersistRequests
from .saving import SavePath, files_of
from .slots import RankSlots

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def _doc_from(source: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give a delegating method the docstring of the method it calls."""
    def take(method: _F) -> _F:
        method.__doc__ = source.__doc__
        return method
    return take


class Checkpointer:
    """Flash checkpoints for one rank. Create one per process, on every rank.

    Its parts, for code that needs more than the methods below: ``slots`` (the rank's
    shared-memory slots), ``attempt`` (what this attempt may load), ``requests`` (persist
    requests to the node's saver), ``saves`` and ``loads`` (the save and load paths),
    ``replicas`` (peer replicas as this rank sees them), ``client`` (the saver connection).
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        config: CheckpointerConfig | None = None,
        *,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any = None,
        **overrides: Any,
    ) -> None:
        config = config or CheckpointerConfig()
        self.config = replace(config, **overrides) if overrides else config
        self.process_group = process_group
        self.rank, self.world_size = collectives.rank_and_world(rank, world_size, process_group)
        url = os.fspath(checkpoint_dir)
        self.url = url if "://" in url else os.path.abspath(os.path.expanduser(url))
        self.storage = storage_from_url(self.url, self.config.storage_options, self.config.storage_factory)
        self.layout: Layout = self.config.layout
        self.job_key = job_key(job_id_for(self.url, self.config.job_id))
        node = self.config.node_id or knobs.get(knobs.NODE_ID) or (
            f"{socket.gethostname()}-{os.environ.get('GROUP_RANK', '0')}"
        )
        self.run_dir = run_dir_for(self.job_key, job_key(node)[:8])
        shm_dir = knobs.get(knobs.SHM_DIR, self.config.shm_dir)
        prefix = os.path.join(shm_dir, f"flashckpt-{os.getuid()}-{self.job_key}-r{self.rank}")
        self.slot_paths = [f"{prefix}-{k}" for k in range(self.config.slots)]
        self._closed = False
        self.replicas = ReplicaHook(self)
        writer = verify.writer_identity()  # in every snapshot's metadata and in the hello
        self.client = SaverClient(self.run_dir, self.rank, start_timeout=self.config.saver_start_timeout_s,
                                  hello={**self.replicas.hello(), "writer": writer})
        self.sums = verify.Checksummer()
        self.slots = RankSlots(self.config, self.rank, prefix, self.run_dir, sums=self.sums,
                               saver_up=lambda: self.client.connected,
                               announce=lambda path: self.requests.announce(path))
        self.attempt = Attempt(self.storage, self.url, self.rank, self.world_size, process_group)
        self.requests = PersistRequests(self.client, self.config, rank=self.rank, world_size=self.world_size,
                                        url=self.url, storage=self.storage, layout=self.layout, writer=writer,
                                        held_path=self.slots.held_path, committed_steps=self.committed_steps)
        self.saves = SavePath(self.config, rank=self.rank, world_size=self.world_size, job_key=self.job_key,
                              writer=writer, slots=self.slots, requests=self.requests, attempt=self.attempt,
                              sums=self.sums, replicas=self.replicas)
        self.loads = LoadPath(self.config, rank=self.rank, world_size=self.world_size, process_group=process_group,
                              url=self.url, storage=self.storage, layout=self.layout, slots=self.slots,
                              attempt=self.attempt, saves=self.saves, sums=self.sums, replicas=self.replicas,
                              client=self.client, check_open=self._check_open)
        self.replicas.bind(client=self.client, slots=self.slots, view=self.attempt.view,
                           snapshots=self.loads.memory_snapshots)
        self.slots.record_paths()
        self.requests.connect_quietly()
        for optimizer in optimizers:
            self.attach_optimizer(optimizer)
        self._atexit = _AtExit(self)
        atexit.register(self._atexit)
        stop_notice.install(self, self.run_dir, self.rank)  # SIGTERM: the saver persists the newest first

    # --- saving ------------------------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for an overlapped snapshot still being copied.

        For a snapshot of accelerator tensors only, the step's stream waits on the copy's done
        event (no host wait); otherwise the step waits on the host (:meth:`wait_for_snapshot`).
        """
        self.saves.attach_optimizer(optimizer)

    def prepare(
        self,
        state: Any = None,
        *,
        files: Mapping[str, Any] | None = None,
        nbytes: int | None = None,
        background: bool = False,
    ) -> None:
        """Create and pre-fault both slots ahead of the first save, sized for ``state`` (and, on
        rank 0, give a new checkpoint directory its identity, which the first save would write).

        With ``background`` the slots are made on a helper thread and this returns at once; a
        save that comes first waits for the slot it writes into (and never for more).
        """
        if self.rank == 0 and not self.attempt.decided:  # the directory's identity, ahead of the first save
            try:
                lineage.ensure_identity(self.storage)
            except Exception as exc:  # the first save reports what is wrong with the storage
                logger.debug("[RANK 0] could not read or write the identity of %s yet: %s", self.url, exc)
        specs = normalize_files(files_of(self.rank, state, files)) if nbytes is None else None
        self.saves.prepare(specs, nbytes, background)

    def save(
        self,
        step: int,
        state: Any = None,
        *,
        files: Mapping[str, Any] | None = None,
        persist: bool = True,
        async_snapshot: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
        folder: str | None = None,
    ) -> SaveResult:
        """Snapshot ``state`` (or ``files``) for ``step`` into memory and optionally persist it.

        Call it on every rank (a rank with nothing to save passes ``files={}``): the commit
        waits for every rank. Returns at once with the outcome; it never drops a checkpoint
        silently: a save that cannot happen returns ``SKIPPED`` or ``FAILED`` with the reason.
        ``folder``: this save's directory, relative to the checkpoint directory, in place of the
        layout's ``step_dir`` (the same on every rank); retention deletes it by its commit record.
        """
        started = time.perf_counter()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        specs = normalize_files(files_of(self.rank, state, files))
        overlap = self.config.async_snapshot if async_snapshot is None else async_snapshot
        result = self.saves.save(step, specs, persist, overlap, metadata, folder)
        if result.status in (SaveStatus.SKIPPED, SaveStatus.FAILED):
            logger.error("[RANK %d] save of step %d %s: %s", self.rank, result.step, result.status.value, result.reason)
        elif result.status is SaveStatus.PERSISTING:
            self.requests.track(result)
        result.blocking_s = time.perf_counter() - started  # the whole call: what the caller was held
        logger.debug("[RANK %d] step %d %s, blocked %.3fs", self.rank, result.step, result.status.value,
                     result.blocking_s)
        return result

    def wait_for_snapshot(self) -> str | None:
        """Block until an overlapped snapshot copy has finished (and a first save's seal, which
        waits for the attempt's record to be on storage).

        Returns ``None`` when it succeeded (or there was none), else the reason it failed. A
        failed overlapped copy never raises here (the optimizer's pre-hook calls this: a failed
        checkpoint does not stop training); it is reported instead: its :class:`SaveResult`
        turns ``FAILED`` (``ok`` false, ``reason`` set) once the copy failed, its ``wait()``
        returns ``committed=False`` with the reason, the error is logged, and the slot is
        invalidated, so ``load()`` uses the previous snapshot or commit. Until the copy is done
        an overlapped save's ``status`` is provisional: read it after ``wait()`` or this.
        """
        return self.saves.wait_for_snapshot()

    def wait(self, timeout: float | None = None) -> PersistResult | None:
        """Wait for every persisting save of this rank to be committed (or to fail).

        Returns the outcome of the newest persisting save, or ``None`` when there was none.
        """
        self.wait_for_snapshot()
        return self.requests.wait(timeout)

    # --- loading -----------------------------------------------------------------------------

    @_doc_from(LoadPath.load)
    def load(self, step: int | None = None, *, target: Any = None, map_location: Any = None,
             prefer_memory: bool = True, weights_only: bool | None = None) -> LoadResult | None:
        return self.loads.load(step, target=target, map_location=map_location, prefer_memory=prefer_memory,
                               weights_only=weights_only)

    @_doc_from(LoadPath.committed_steps)
    def committed_steps(self) -> list[int]:
        return self.loads.committed_steps()

    @_doc_from(LoadPath.memory_steps)
    def memory_steps(self) -> list[int]:
        return self.loads.memory_steps()

    @_doc_from(LoadPath.memory_snapshots)
    def memory_snapshots(self) -> dict[int, tuple[Slot, dict[str, Any]]]:
        return self.loads.memory_snapshots()

    @_doc_from(LoadPath.start_attempt)
    def start_attempt(self, resumed_step: int | None = None, *, from_memory: bool = False,
                      tag: Mapping[str, Any] | None = None) -> None:
        self.loads.start_attempt(resumed_step, from_memory=from_memory, tag=tag)

    @_doc_from(LoadPath.recover_replicas)
    def recover_replicas(self, step: int | None = None) -> int | None:
        return self.loads.recover_replicas(step)

    @_doc_from(LoadPath.check_memory)
    def check_memory(self, step: int) -> bool:
        return self.loads.check_memory(step)

    @_doc_from(LoadPath.committed_folder)
    def committed_folder(self, step: int) -> str | None:
        return self.loads.committed_folder(step)

    @_doc_from(LoadPath.snapshot_folder)
    def snapshot_folder(self, step: int) -> str | None:
        return self.loads.snapshot_folder(step)

    @_doc_from(LoadPath.committed_entries)
    def committed_entries(self, step: int) -> dict[str, dict[str, Any]]:
        return self.loads.committed_entries(step)

    @_doc_from(LoadPath.read_file)
    def read_file(self, step: int, path: str, codec: Codec | str = Codec.TORCH, **kwargs: Any) -> Any:
        return self.loads.read_file(step, path, codec, **kwargs)

    # --- the end -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, *, wait: bool = True) -> None:
        """Finish in-flight work, leave the saver, and free this rank's shared memory."""
        if self._closed:
            return
        failed = False
        try:
            if wait:
                self.wait()
            self._warn_if_newest_is_memory_only()
        except Exception:
            failed = True
            raise
        finally:
            self.shutdown(clean=not failed)

    def _warn_if_newest_is_memory_only(self) -> None:
        memory = self.memory_steps()
        committed = self.committed_steps()
        if memory and (not committed or memory[-1] > committed[-1]):
            logger.warning(
                "[RANK %d] step %d was only in memory and is discarded by close() (newest on storage: %s); "
                "save it with persist=True before close() to keep it", self.rank, memory[-1],
                committed[-1] if committed else None,
            )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.shutdown(clean=False)

    def _check_open(self) -> None:
        if self._closed:
            raise FlashCkptError("this Checkpointer is closed; create a new one")

    def shutdown(self, clean: bool) -> None:
        """End without waiting for anything more: ``clean`` frees the shared memory; otherwise it
        is kept for a restart, and unanswered persist requests are left to the node's saver."""
        if self._closed:
            return
        self._closed = self.slots.closed = True
        atexit.unregister(self._atexit)
        stop_notice.uninstall(self)
        if not clean:  # answers still awaited (a commit a lost peer holds up) are not waited for
            self.requests.leave()
        self.slots.stop_background()  # a queued purge (retention after a direct commit) still runs
        self.saves.close()
        self.attempt.close()  # a first save's seal hands its persist to the request thread
        self.sums.wait()  # slots left for a restart keep their checksums
        self.sums.close()
        self.requests.close()
        self.replicas.close()
        self.client.close(clean=clean)
        self.slots.close(clean)


class _AtExit:
    """At interpreter exit: wait for in-flight persisting, keep memory for a restart."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._ref = weakref.ref(checkpointer)

    def __call__(self) -> None:
        checkpointer = self._ref()
        if checkpointer is None or checkpointer.closed:
            return
        failing = getattr(sys, "last_value", None) is not None  # the interpreter printed an uncaught error
        try:
            checkpointer.wait(ERROR_EXIT_WAIT_S if failing else None)
        except concurrent.futures.TimeoutError:
            logger.warning("[RANK %d] exiting on an error with checkpoints still being persisted or committed; "
                           "the node's saver finishes them (a step a lost peer cannot complete is not committed)",
                           checkpointer.rank)
        except Exception as exc:
            logger.error("[RANK %d] in-flight checkpoints did not finish at exit: %s", checkpointer.rank, exc)
        checkpointer.shutdown(clean=False)
