"""A short health and speed check of every node, run before training.

Each rank runs a fixed compute on its local device (a :class:`NodeCheck`), then the ranks time a
small all_reduce, gather every rank's result with its hostname, and the local rank 0 of each node
writes the same JSON report (rank 0's is the reference). A rank whose check raised, or whose compute
took more than ``slow_factor`` times the median of all ranks (the lower median, so that one slow rank
out of two is still caught), is reported by hostname and rank, and every rank exits with status 1.

Two ways in:

- ``python -m flashckpt_integrations.launcher.node_check --report PATH`` under torchrun, on every
  rank of every node (the worker entry point);
- :func:`run_node_check` from a launcher: it runs that entry point through torch's
  ``elastic_launch`` with the training job's ``LaunchConfig`` and returns the parsed report or
  raises :class:`~flashckpt_integrations.errors.NodeCheckError` naming the failed and slow nodes.
  Every node calls it, as every node launches training.

Checks are plugins: subclass :class:`NodeCheck` and register it with :func:`register_node_check`,
from a module named in ``$FLASHCKPT_NODE_CHECK_PLUGINS`` or through the ``entry_points`` group
``flashckpt_integrations.node_checks``. Built-ins: ``cuda``, ``npu`` (when ``torch_npu`` imports)
and ``cpu``. The last registered check whose ``available()`` is true is used, so plugins come before
the built-ins, and the built-ins are tried as cuda, npu, cpu.

The result exchange runs on gloo, so a broken accelerator is reported rather than hanging the
collective; the timed all_reduce runs on the device's own backend (nccl for CUDA, gloo on CPU) and
only once every rank's compute check passed.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .. import knobs
from ..errors import NodeCheckError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "flashckpt_integrations.node_checks"
WORKER_MODULE = "flashckpt_integrations.launcher.node_check"
DEFAULT_SLOW_FACTOR = 2.0
REPORT_VERSION = 1


class NodeCheck(abc.ABC):
    """A short, fixed piece of work on one device, timed.

    Call order, on every rank: ``available()``; if true, ``run(local_device_index)`` once to warm up
    and then a few more times (the fastest counts). ``run`` returns the seconds its fixed work took;
    an exception marks the rank as failed. ``device_type`` picks the device of the timed all_reduce
    and its backend (``torch.distributed.Backend.default_device_backend_map``).
    """

    name: ClassVar[str]
    device_type: ClassVar[str] = "cpu"

    @abc.abstractmethod
    def available(self) -> bool:
        """Whether this node has what the check needs (cheap; no work on the device)."""

    @abc.abstractmethod
    def run(self, device_index: int) -> float:
        """Do the fixed work on local device ``device_index``; return the seconds it took."""

    def device(self, device_index: int) -> torch.device:
        return torch.device("cpu") if self.device_type == "cpu" else torch.device(self.device_type, device_index)


class MatmulNodeCheck(NodeCheck):
    """``iterations`` square matmuls of ``size`` in ``dtype`` on the check's device."""

    size: ClassVar[int] = 256
    iterations: ClassVar[int] = 16
    dtype: ClassVar[torch.dtype] = torch.float32

    def run(self, device_index: int) -> float:
        device = self.device(device_index)
        a = torch.randn(self.size, self.size, device=device, dtype=self.dtype)
        out = torch.empty_like(a)
        self._synchronize(device)
        start = time.perf_counter()
        for _ in range(self.iterations):
            torch.mm(a, a, out=out)
        self._synchronize(device)
        return time.perf_counter() - start

    @staticmethod
    def _synchronize(device: torch.device) -> None:
        if device.type != "cpu":
            torch.get_device_module(device.type).synchronize(device)


class CpuNodeCheck(MatmulNodeCheck):
    name = "cpu"

    def available(self) -> bool:
        return True


class CudaNodeCheck(MatmulNodeCheck):
    name = "cuda"
    device_type = "cuda"
    size = 4096
    iterations = 32
    dtype = torch.bfloat16

    def available(self) -> bool:
        return torch.cuda.is_available()

    def run(self, device_index: int) -> float:
        torch.cuda.set_device(device_index)
        return super().run(device_index)


class NpuNodeCheck(MatmulNodeCheck):
    name = "npu"
    device_type = "npu"
    size = 4096
    iterations = 32
    dtype = torch.float16

    def available(self) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            importlib.import_module("torch_npu")
            return bool(torch.npu.is_available())  # type: ignore[attr-defined]
        except Exception as exc:  # a broken vendor stack must not hide the other checks
            logger.warning("torch_npu is installed but does not work (%s); skipping the NPU check.", exc)
            return False


_REGISTRY: dict[str, NodeCheck] = {}
_plugins_loaded = False


def register_node_check(check: Any) -> Any:
    """Register a :class:`NodeCheck` subclass or instance (usable as a class decorator).

    A later registration wins over earlier ones, both in selection order and for a repeated name.
    """
    instance = check() if isinstance(check, type) else check
    if not isinstance(instance, NodeCheck) or not getattr(instance, "name", ""):
        raise TypeError(f"register_node_check takes a NodeCheck subclass or instance with a `name`, got {check!r}.")
    _REGISTRY.pop(instance.name, None)
    _REGISTRY[instance.name] = instance
    return check


def unregister_node_check(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered_node_checks() -> list[str]:
    """Names of the registered checks, in selection order (first tried first)."""
    _ensure_plugins()
    return list(reversed(_REGISTRY))


def load_node_check_plugins() -> None:
    """Register the ``flashckpt_integrations.node_checks`` entry points, then import the modules in
    ``$FLASHCKPT_NODE_CHECK_PLUGINS`` (so these come last, and are tried first)."""
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_node_check(entry_point.load())
        except Exception as exc:  # one broken package must not stop the check; it is named
            logger.warning("Skipping node check plugin %s (%s): %s", entry_point.name, entry_point.value, exc)
    for module in (knobs.get(knobs.NODE_CHECK_PLUGINS) or "").split(","):
        if module.strip():
            importlib.import_module(module.strip())


def _ensure_plugins() -> None:
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        load_node_check_plugins()


def select_node_check(name: str | None = None) -> NodeCheck:
    """The check named ``name``, or the last registered one that is available on this node."""
    _ensure_plugins()
    if name is not None:
        check = _REGISTRY.get(name)
        if check is None:
            raise NodeCheckError(f"No node check is registered as {name!r}; registered: {registered_node_checks()}. "
                                 f"Install or name the plugin module in ${knobs.NODE_CHECK_PLUGINS}.")
        if not check.available():
            raise NodeCheckError(f"The node check {name!r} is not available on {socket.gethostname()}.")
        return check
    for check in reversed(list(_REGISTRY.values())):
        if check.available():
            return check
    raise NodeCheckError(f"None of the node checks {registered_node_checks()} is available on {socket.gethostname()}.")


for _builtin in (CpuNodeCheck, NpuNodeCheck, CudaNodeCheck):
    register_node_check(_builtin)


@dataclasses.dataclass(frozen=True)
class RankResult:
    """One rank's outcome."""

    rank: int
    local_rank: int
    hostname: str
    check: str | None
    compute_s: float | None
    """Fastest of the timed runs of the check; ``None`` when it failed."""
    collective_s: float | None = None
    """Mean seconds of one small all_reduce (``None`` when it was skipped or failed)."""
    error: str | None = None

    @property
    def where(self) -> str:
        return f"{self.hostname} rank {self.rank} (local rank {self.local_rank})"


@dataclasses.dataclass(frozen=True)
class NodeCheckReport:
    """Every rank's result and the verdict."""

    ranks: tuple[RankResult, ...]
    slow_factor: float
    median_compute_s: float | None
    failed: tuple[int, ...]
    """Ranks whose check or all_reduce raised."""
    slow: tuple[int, ...]
    """Ranks whose compute took more than ``slow_factor`` times ``median_compute_s``."""

    @property
    def ok(self) -> bool:
        return not self.failed and not self.slow

    def bad_hosts(self) -> list[str]:
        bad = set(self.failed) | set(self.slow)
        return sorted({r.hostname for r in self.ranks if r.rank in bad})

    def problems(self) -> list[str]:
        lines = [f"{r.where}: {r.error}" for r in self.ranks if r.rank in self.failed]
        for r in self.ranks:
            if r.rank in self.slow and r.compute_s is not None and self.median_compute_s:
                lines.append(f"{r.where}: compute took {r.compute_s:.4f} s, {r.compute_s / self.median_compute_s:.1f}x "
                             f"the median {self.median_compute_s:.4f} s (limit {self.slow_factor:g}x)")
        return lines

    def summary(self) -> str:
        if self.ok:
            hosts = len({r.hostname for r in self.ranks})
            return (f"Node check passed on {len(self.ranks)} ranks of {hosts} host{'s' * (hosts != 1)} "
                    f"(median compute {self.median_compute_s or 0:.4f} s).")
        return (f"Node check found problems on {', '.join(self.bad_hosts())}: " + "; ".join(self.problems()) +
                ". Drain or fix these nodes and relaunch, or raise the slow factor if the gap is expected.")

    def __str__(self) -> str:
        return self.summary()

    def to_json(self) -> dict[str, Any]:
        return {"version": REPORT_VERSION, "ok": self.ok, "slow_factor": self.slow_factor,
                "median_compute_s": self.median_compute_s, "failed_ranks": list(self.failed),
                "slow_ranks": list(self.slow), "bad_hosts": self.bad_hosts(),
                "ranks": [dataclasses.asdict(r) for r in self.ranks]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeCheckReport:
        if data.get("version") != REPORT_VERSION:
            raise NodeCheckError(f"Node check report version {data.get('version')!r} is not {REPORT_VERSION}; "
                                 "the launcher and the workers run different flashckpt-integrations versions.")
        return cls(ranks=tuple(RankResult(**r) for r in data["ranks"]), slow_factor=data["slow_factor"],
                   median_compute_s=data["median_compute_s"], failed=tuple(data["failed_ranks"]),
                   slow=tuple(data["slow_ranks"]))


def evaluate(results: Sequence[RankResult], slow_factor: float = DEFAULT_SLOW_FACTOR) -> NodeCheckReport:
    """The verdict on gathered results: failed ranks, and ranks slower than ``slow_factor`` x median."""
    ranks = tuple(sorted(results, key=lambda r: r.rank))
    times = [r.compute_s for r in ranks if r.error is None and r.compute_s is not None]
    median = statistics.median_low(times) if times else None
    failed = tuple(r.rank for r in ranks if r.error is not None or r.compute_s is None)
    slow = tuple(r.rank for r in ranks if r.rank not in failed and median and r.compute_s > slow_factor * median)
    return NodeCheckReport(ranks, slow_factor, median, failed, slow)


# ---------------------------------------------------------------- worker (one process per rank)

def _parse_worker_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, help="JSON report path, written by each node's local rank 0")
    parser.add_argument("--slow-factor", type=float, default=DEFAULT_SLOW_FACTOR,
                        help="flag ranks slower than this times the median (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before a stuck rank dumps its stacks and exits 1 (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up; the fastest counts")
    parser.add_argument("--check", default=None, help="use this registered check instead of the first available")
    return parser.parse_args(argv)


def _run_check(name: str | None, local_rank: int, repeats: int) -> tuple[RankResult, NodeCheck | None]:
    base: dict[str, Any] = dict(rank=dist.get_rank(), local_rank=local_rank, hostname=socket.gethostname())
    check = None
    try:
        check = select_node_check(name)
        check.run(local_rank)  # warm-up: allocation, kernels, library handles
        seconds = min(check.run(local_rank) for _ in range(max(1, repeats)))
        return RankResult(**base, check=check.name, compute_s=seconds), check
    except Exception as exc:  # reported by hostname and rank, never swallowed
        logger.warning("Node check failed on %s rank %d", base["hostname"], base["rank"], exc_info=True)
        return RankResult(**base, check=check.name if check else None, compute_s=None,
                          error=f"{type(exc).__name__}: {exc}"), None


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _mark_mismatched(results: list[RankResult]) -> list[RankResult]:
    """Ranks that ran another check than the most common one fail (their devices cannot all_reduce)."""
    names = [r.check for r in results if r.error is None]
    if not names:
        return results
    common = max(set(names), key=names.count)
    return [r if r.error is not None or r.check == common else
            dataclasses.replace(r, compute_s=None, error=f"ran the {r.check!r} check while most ranks ran {common!r}")
            for r in results]


def _time_collective(check: NodeCheck, local_rank: int, timeout: datetime.timedelta, iterations: int = 10) -> float:
    group = None
    device = check.device(local_rank)
    if check.device_type != "cpu":
        backend = dist.Backend.default_device_backend_map.get(check.device_type, "gloo")
        group = dist.new_group(backend=backend, timeout=timeout)
    tensor = torch.ones(1024, device=device)
    dist.all_reduce(tensor, group=group)  # warm-up: communicator creation
    MatmulNodeCheck._synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor, group=group)
    MatmulNodeCheck._synchronize(device)
    return (time.perf_counter() - start) / iterations


def _with_collective(results: list[RankResult], check: NodeCheck | None, local_rank: int,
                     timeout: datetime.timedelta) -> list[RankResult]:
    """Time an all_reduce once every rank's compute check passed, and fold the timings in."""
    if check is None or any(r.error is not None for r in results):
        return results
    try:
        mine: tuple[float | None, str | None] = (_time_collective(check, local_rank, timeout), None)
    except Exception as exc:  # reported for this rank
        logger.warning("all_reduce failed on rank %d", dist.get_rank(), exc_info=True)
        mine = (None, f"all_reduce failed: {type(exc).__name__}: {exc}")
    timings = _gather(mine)
    return [dataclasses.replace(r, collective_s=t, error=e, compute_s=r.compute_s if e is None else None)
            for r, (t, e) in zip(results, timings)]


def write_report(path: str, report: NodeCheckReport) -> None:
    """Write ``report`` atomically (nodes sharing a file system may write the same path)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(report.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """The worker: run the check on this rank, gather, judge, write the report; 0 when all is well."""
    args = _parse_worker_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    try:
        result, check = _run_check(args.check, local_rank, args.repeats)
        results = _mark_mismatched(_gather(result))
        if results[rank].error is not None:
            check = None
        report = evaluate(_with_collective(results, check, local_rank, timeout), args.slow_factor)
        if local_rank == 0:
            write_report(args.report, report)
        dist.barrier()  # nobody exits (and gets the others killed) before every report is written
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        print(report.summary(), flush=True)
    return 0 if report.ok else 1


# ---------------------------------------------------------------- launcher side

def run_node_check(
    launch_config: Any,
    timeout_s: float,
    *,
    slow_factor: float = DEFAULT_SLOW_FACTOR,
    check: str | None = None,
    repeats: int = 3,
    report_path: str | None = None,
) -> NodeCheckReport:
    """Run the node check on this node's ranks with ``launch_config`` and return the report.

    ``report_path`` keeps this node's JSON report there (the failed checks too); by default it
    lives in a temporary directory only while the check runs.

    ``launch_config`` is the training job's ``torch.distributed.launcher.api.LaunchConfig``; the check
    runs with no restarts, under its own run id, and with rendezvous timeouts capped at ``timeout_s``
    (each rank also exits after ``timeout_s``). Raises :class:`NodeCheckError` naming the failed or
    slow hosts and ranks, or why no report came back.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if slow_factor <= 1:
        raise ValueError(f"slow_factor must be above 1 (a rank this many times slower than the median "
                         f"fails), got {slow_factor}.")
    config = _check_config(launch_config, timeout_s)
    with tempfile.TemporaryDirectory(prefix="flashckpt-node-check-") as tmp:
        path = os.path.abspath(report_path) if report_path else os.path.join(tmp, "report.json")
        if report_path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # an old report must not pass for this check's
        args = ["-u", "-m", WORKER_MODULE, "--report", path, "--slow-factor", str(slow_factor),
                "--timeout", str(timeout_s), "--repeats", str(repeats), *(["--check", check] if check else [])]
        launch_error: ChildFailedError | None = None
        start = time.monotonic()
        try:
            elastic_launch(config, sys.executable)(*args)
        except ChildFailedError as exc:
            launch_error = exc
        except Exception as exc:
            raise NodeCheckError(f"The node check could not run on {socket.gethostname()}: {type(exc).__name__}: "
                                 f"{exc}. Check that every node started the job and can reach the rendezvous "
                                 "endpoint.") from exc
        report = _read_report(path)
    logger.info("Node check took %.1f s.", time.monotonic() - start)
    if report is None:
        raise NodeCheckError(_no_report_message(launch_error)) from launch_error
    if not report.ok:  # the workers exited 1: launch_error holds their exit codes
        raise NodeCheckError(report.summary(), report=report) from launch_error
    logger.info("%s", report.summary())
    return report


def _check_config(launch_config: Any, timeout_s: float) -> Any:
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
    capped = max(1, int(timeout_s))
    rdzv_configs = dict(launch_config.rdzv_configs)
    for key in ("timeout", "join_timeout"):
        rdzv_configs[key] = min(int(rdzv_configs.get(key, capped)), capped)
    return dataclasses.replace(launch_config, max_restarts=0, rdzv_configs=rdzv_configs,
                               run_id=f"{launch_config.run_id or 'flashckpt'}-node-check")


def _read_report(path: str) -> NodeCheckReport | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise NodeCheckError(f"The node check report {path} is unreadable ({exc}); rerun the check.") from exc
    return NodeCheckReport.from_json(data)


def _no_report_message(error: Exception | None) -> str:
    host = socket.gethostname()
    if error is None:
        return f"The node check on {host} finished without writing its report; rerun it, and check the disk."
    failures = getattr(error, "failures", {})
    ranks = ", ".join(f"{host} rank {rank} (local rank {f.local_rank}, exit code {f.exitcode})"
                      for rank, f in sorted(failures.items())) or host
    return (f"The node check crashed before it could report: {ranks}. Its output above shows why "
            "(a stuck rank dumps its stacks after the timeout).")


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: plugins register into the former.
    from flashckpt_integrations.launcher import node_check as _node_check

    sys.exit(_node_check.main())
