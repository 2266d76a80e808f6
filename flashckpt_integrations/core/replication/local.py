"""This node's own ranks' slots, as its saver finds them: through the records the ranks write in
the saver's run directory (``slots-r<rank>.json``, :data:`~flashckpt_integrations.core.protocol.SLOTS_FILE`).

Read only: a round (:mod:`.rounds`) copies the complete snapshots it finds here into the replica
store, a receiver (:mod:`.reuse`) takes data-parallel pieces from them, and the ``inventory``
answer lists them. No torch here.
"""

from __future__ import annotations

from ...errors import CorruptCheckpointError, SharedMemoryError
from ..protocol import read_slot_records
from ..shm_buffer import Slot, SlotHeader, attach_complete


def local_slots(run_dir: str) -> dict[int, list[str]]:
    """This node's ranks and their slot files, from the ranks' records in the saver's run directory."""
    return read_slot_records(run_dir)


def open_complete(path: str) -> tuple[Slot, SlotHeader] | None:
    """The slot at ``path`` (the caller closes it) and its header when it holds a complete
    snapshot; None when there is no slot, no complete snapshot or no readable header."""
    try:
        return attach_complete(path)
    except (SharedMemoryError, OSError, CorruptCheckpointError):
        return None


def local_snapshots(run_dir: str) -> list[tuple[int, str, SlotHeader]]:
    """``(rank, slot file, header)`` of every complete snapshot in this node's ranks' own slots."""
    found = []
    for rank, paths in local_slots(run_dir).items():
        for path in paths:
            opened = open_complete(path)
            if opened is not None:
                opened[0].close()
                found.append((rank, path, opened[1]))
    return found


def local_inventory(run_dir: str) -> list[dict[str, int]]:
    """The complete snapshots in this node's ranks' own slots, as JSON-ready dicts."""
    return [{"rank": rank, "step": header.step, "seq": header.seq} for rank, _, header in local_snapshots(run_dir)]
