"""Node checks loaded by the node-check tests through ``FLASHCKPT_NODE_CHECK_PLUGINS``.

Importing this module registers :class:`FaultyCpuCheck`, which then wins over the built-ins: it is
the CPU check, except that the rank named by ``$FLASHCKPT_TEST_SLOW_RANK`` really sleeps and the rank
named by ``$FLASHCKPT_TEST_FAIL_RANK`` raises.
"""

from __future__ import annotations

import os
import time

from flashckpt_integrations.launcher.node_check import CpuNodeCheck, register_node_check

SLOW_RANK = "FLASHCKPT_TEST_SLOW_RANK"
FAIL_RANK = "FLASHCKPT_TEST_FAIL_RANK"
DELAY_S = 0.3


@register_node_check
class FaultyCpuCheck(CpuNodeCheck):
    name = "test-faulty-cpu"

    def run(self, device_index: int) -> float:
        rank = os.environ.get("RANK")
        if rank == os.environ.get(FAIL_RANK):
            raise RuntimeError(f"injected failure on rank {rank}")
        start = time.perf_counter()
        super().run(device_index)
        if rank == os.environ.get(SLOW_RANK):
            time.sleep(DELAY_S)
        return time.perf_counter() - start


class EntryPointCheck(CpuNodeCheck):
    """Registered only through an ``entry_points`` declaration (not on import)."""

    name = "test-entry-point"
