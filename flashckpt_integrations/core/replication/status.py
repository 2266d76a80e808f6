"""The saver's replication status file, in its run directory, for ``flashckpt ls``.

One JSON object (``replication.json``): the saver's listener and place (``listen``, ``node_rank``,
``nnodes``, ``replicas``, ``targets``), the outcome of the newest copy of each rank to each peer
(``sent``: rank -> node -> ``step``, ``seq``, ``time``, ``ok`` and ``reason`` or ``seconds``,
``bytes``, ``sent``), and with rounds the job's ``kept`` step and the leader's tally (``rounds``).
Rewritten whole (a temporary renamed into place) at each change. No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any

STATUS_FILE = "replication.json"
"""In the saver's run directory: its listener, its peers and the outcome of its newest copies."""


class StatusFile:
    """The status of one saver's replication (thread-safe: every sender and the rounds report)."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, STATUS_FILE)
        self._status: dict[str, Any] = {"sent": {}}
        self._lock = threading.Lock()

    def report(self, node: int, note: dict[str, Any], **outcome: Any) -> None:
        """Record the outcome of a copy of the snapshot ``note`` names (rank, step, seq) to ``node``."""
        with self._lock:
            sent = self._status["sent"].setdefault(str(note["rank"]), {})
            sent[str(node)] = {"step": note["step"], "seq": note["seq"], "time": time.time(), **outcome}
            self._write()

    def update(self, **fields: Any) -> None:
        """Set top-level fields (the saver's place, the kept step, the rounds' tally)."""
        with self._lock:
            self._status.update(fields)
            self._write()

    def remove(self) -> None:
        """Remove the file (the job ended cleanly)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _write(self) -> None:
        with contextlib.suppress(OSError):
            with open(self.path + ".tmp", "w") as f:
                json.dump(self._status, f)
            os.replace(self.path + ".tmp", self.path)
