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
FAULT = "FLASHCKPT_FAULT"
"""Fault injection (tests only): ``point[@n][,point[@n]...]`` SIGKILLs the process the n-th time
(default: the first) it reaches ``point``; see ``flashckpt_integrations/_utils/faults.py``."""
NODE_CHECK_PLUGINS = "FLASHCKPT_NODE_CHECK_PLUGINS"
"""Comma-separated modules the node check imports before it picks a check (they call
``register_node_check``; the last registered available check wins). Tests use it to make a rank slow."""


def get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value else default
