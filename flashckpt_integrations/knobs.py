"""Environment-variable overrides, for tests and debugging only.

Every knob lives here so that the rest of the code never reads ``os.environ`` for tuning.
"""

from __future__ import annotations

import os

JOB_ID = "FLASHCKPT_JOB_ID"
NODE_ID = "FLASHCKPT_NODE_ID"
RUN_DIR = "FLASHCKPT_RUN_DIR"
SHM_DIR = "FLASHCKPT_SHM_DIR"
SAVER_LOG_LEVEL = "FLASHCKPT_SAVER_LOG_LEVEL"
SAVER_IDLE_EXIT = "FLASHCKPT_SAVER_IDLE_EXIT"
SAVER_KEEP_RUN_DIR = "FLASHCKPT_SAVER_KEEP_RUN_DIR"
"""Keep the saver's run directory (and its log) even after a job that every rank closed cleanly,
which otherwise removes it: for tests and debugging that read the log afterwards."""
SAVER_NICE = "FLASHCKPT_SAVER_NICE"
"""Niceness added to the saver (default 10): training keeps the CPU when both want it."""
DIRECT_IO = "FLASHCKPT_DIRECT_IO"
"""``0``: local storage writes through the page cache (default: ``O_DIRECT`` where the file system
takes it, see ``core/storage.py``)."""
WARM_START = "FLASHCKPT_WARM_START"
"""``0``: ``flashckpt-run`` starts every worker as a new interpreter (default: forked from a
process that has imported torch, see ``launcher/warm_start.py``)."""
FAULT = "FLASHCKPT_FAULT"
"""Fault injection (tests only): ``point[@n][,point[@n]...]`` SIGKILLs the process the n-th time
(default: the first) it reaches ``point``; see ``flashckpt_integrations/_utils/faults.py``."""
REPLICAS = "FLASHCKPT_REPLICAS"
"""Replica count (0, 1 or 2), in place of ``CheckpointerConfig.replicas``: how many peer nodes keep
a copy of each node's newest memory snapshots (see ``core/replication/``)."""
REPLICA_SECRET = "FLASHCKPT_REPLICA_SECRET"
"""The job's replication secret, when the launcher hands one to every node (default: a 0600 file
in the checkpoint directory's ``.flashckpt``, made by the first saver)."""
REPLICA_ADDR = "FLASHCKPT_REPLICA_ADDR"
"""The address a saver listens on for its peers and publishes (default: the interface that routes
toward MASTER_ADDR)."""
REPLICA_SHM_RESERVE = "FLASHCKPT_REPLICA_SHM_RESERVE"
"""Bytes of shared memory a saver leaves free when it takes a replica (default: 10% of the file
system); a replica that needs more is skipped and reported."""
REPLICA_REUSE = "FLASHCKPT_REPLICA_REUSE"
"""``0``: a saver takes every peer's replica whole, never copying identical data-parallel bytes
from its own ranks' snapshots (see ``core/replication/reuse.py``; default on)."""
REPLICA_DUTY = "FLASHCKPT_REPLICA_DUTY"
"""The share of the time a saver's copies to one peer may take, in (0, 1] (default 0.1): after a
copy of ``d`` seconds the next waits ``d * (1 / duty - 1)``; 1 copies back to back."""
REPLICA_CPU = "FLASHCKPT_REPLICA_CPU"
"""The share of a node's CPU time replication rounds may take, in (0, 1] (default 0.01): a round
whose copies cost its busiest node ``c`` CPU seconds is followed by one no sooner than
``c / (share * CPUs)`` seconds later (and no sooner than ``FLASHCKPT_REPLICA_DUTY`` allows)."""
REPLICA_IDLE = "FLASHCKPT_REPLICA_IDLE"
"""The share of a node's idle CPU time replication rounds may take beyond ``FLASHCKPT_REPLICA_CPU``,
in (0, 1] (default 0.5): on a node whose CPUs wait for its GPUs, rounds follow each other as fast
as that idle time pays for them, and the kept step trails the newest snapshot by about a round."""
REPLICA_ROUNDS = "FLASHCKPT_REPLICA_ROUNDS"
"""``0``: each saver copies the newest snapshot of each of its ranks on its own, with no step kept
in common (see ``core/replication/rounds.py``; default on: job-wide rounds led by node 0's saver)."""
GRACE_S = "FLASHCKPT_GRACE_S"
"""Seconds between SIGTERM and SIGKILL when the job is stopped (default 30, Kubernetes' default
``terminationGracePeriodSeconds``): the node's saver persists the newest memory snapshot within
it (see ``core/preemption.py``). Set it to the grace your scheduler gives."""
STOP_NOTICE = "FLASHCKPT_STOP_NOTICE"
"""``0``: a rank that gets SIGTERM dies at once, as without flashckpt. Default on: it first asks its
node's saver to persist the newest snapshot and waits for that, within ``FLASHCKPT_GRACE_S`` (see
``core/stop_notice.py``); ``flashckpt-run`` sets ``0`` for its workers, it persists on SIGTERM itself."""
NODE_CHECK_PLUGINS = "FLASHCKPT_NODE_CHECK_PLUGINS"
"""Comma-separated modules the node check imports before it picks a check (they call
``register_node_check``; the last registered available check wins). Tests use it to make a rank slow."""


def get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value else default
