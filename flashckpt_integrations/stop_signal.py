"""A last save when the job is being stopped (SIGTERM), for a training loop of one's own.

A preempted job gets SIGTERM, then SIGKILL once the grace period is over. By default a rank dies
at SIGTERM and the node's saver persists the newest snapshot in memory (see
:mod:`flashckpt_integrations.core.preemption`). With :class:`StopSignal` the ranks instead finish
the step they are in, save it with ``persist=True`` and leave: the saver, stopped by the same
signal, serves that save while the grace leaves room.

Call order, in every rank's main thread:

1. ``stop = StopSignal()`` before the loop: SIGTERM (and SIGINT) now set ``stop.requested``
   instead of ending the process.
2. At each step boundary, on every rank: ``if stop.agreed():`` (one all-reduce of one number, so
   that every rank stops at the same step) save that step with ``persist=True``, ``ck.wait()``, and
   leave the loop. ``stop.requested`` is this process's own flag, without the collective.
3. ``stop.restore()`` (or the end of a ``with StopSignal() as stop:`` block) puts the previous
   handlers back.

```python
with StopSignal() as stop:
    for step in range(start, steps):
        train_step()
        last = stop.agreed()
        ck.save(step, state, persist=last or step % 100 == 0)
        if last:
            ck.wait()  # committed (or failed) before the process exits
            break
```
"""

from __future__ import annotations

import logging
import signal
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["StopSignal"]


class StopSignal:
    """SIGTERM and SIGINT set :attr:`requested` (see the module docstring for the loop)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if not self.requested:
            self.requested = True
            logger.warning("%s: the job is being stopped; the next step boundary takes a last save",
                           signal.Signals(signum).name)

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (a collective: call it at the same point on every rank).

        Without a process group it is :attr:`requested`.
        """
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        """Put back the handlers there were before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.restore()
