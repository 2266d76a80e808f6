"""Fill in torchrun's node and process counts from the environment (``flashckpt-run --auto-config``).

:func:`auto_config_args` adds ``--nnodes``, ``--nproc-per-node``, ``--node-rank``, ``--master-addr``
and ``--master-port`` to a torchrun argv where the user did not give them. Arguments the user gave
always win. The values come from (first listed first):

=================  ==================================================  ==========================
option             environment variables                               when nothing is set
=================  ==================================================  ==========================
--nnodes           ``PET_NNODES``, ``NNODES``, else ``WORLD_SIZE``     torchrun's default (1)
--nproc-per-node   ``PET_NPROC_PER_NODE``, ``NPROC_PER_NODE``          the node's devices
--node-rank        ``PET_NODE_RANK``, ``NODE_RANK``, ``RANK`` [#]_     torchrun's default (0)
--master-addr      ``PET_MASTER_ADDR``, ``MASTER_ADDR``                torchrun's default
--master-port      ``PET_MASTER_PORT``, ``MASTER_PORT``                torchrun's default
=================  ==================================================  ==========================

.. [#] ``RANK`` counts as the node rank only next to ``WORLD_SIZE`` (a Kubeflow PyTorchJob pod).

What the Kubeflow operators set, per pod:

- training-operator v1 ``PyTorchJob`` (with a Master replica): ``MASTER_ADDR``, ``MASTER_PORT``,
  ``RANK`` (the pod's index: master 0, worker *i* is *i+1*) and ``WORLD_SIZE``. Up to v1.6
  ``WORLD_SIZE`` is the number of pods. From v1.7 it is pods times ``nprocPerNode`` when that is an
  integer (pods otherwise), and the operator also sets ``PET_NNODES`` (pods, or ``"min:max"`` with an
  elastic policy), ``PET_NODE_RANK`` (= ``RANK``) and ``PET_NPROC_PER_NODE`` (``spec.nprocPerNode``
  verbatim: an integer, or ``auto``, ``cpu`` or ``gpu``). So ``WORLD_SIZE`` is used as the node count
  only when no ``PET_NNODES``/``NNODES`` is set, and otherwise must equal nodes or nodes times
  processes per node.
- Kubeflow Trainer v2 ``TrainJob``: ``PET_NNODES``, ``PET_NPROC_PER_NODE`` (default ``auto``),
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``; no ``WORLD_SIZE``/``RANK``.

``auto``, ``cpu`` and ``gpu`` for the processes per node are resolved here: ``auto`` is the number of
CUDA devices, else of NPUs (when ``torch_npu`` imports), else the CPU slots; CPU slots are the CPUs
in this process's affinity mask, capped by the cgroup's CPU quota (v1 or v2) when one is set.
Two variables for the same option that disagree raise :class:`ValueError` naming both.
With ``--standalone`` only the processes per node are filled in; with a rendezvous endpoint or a
non-static rendezvous backend the node rank and master address/port are left out (torchrun ignores
them there).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence

import torch

from .._utils.cpus import affinity_cpus

logger = logging.getLogger(__name__)

NNODES, NPROC_PER_NODE, NODE_RANK, MASTER_ADDR, MASTER_PORT = (
    "nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port")
OPTIONS = (NNODES, NPROC_PER_NODE, NODE_RANK, MASTER_ADDR, MASTER_PORT)
"""The torchrun options (argparse ``dest`` names) that auto-config fills in."""

ENV_SOURCES: dict[str, tuple[str, ...]] = {
    NNODES: ("PET_NNODES", "NNODES"),
    NPROC_PER_NODE: ("PET_NPROC_PER_NODE", "NPROC_PER_NODE"),
    NODE_RANK: ("PET_NODE_RANK", "NODE_RANK"),
    MASTER_ADDR: ("PET_MASTER_ADDR", "MASTER_ADDR"),
    MASTER_PORT: ("PET_MASTER_PORT", "MASTER_PORT"),
}
"""Environment variables read for each option, first listed first."""

SYMBOLIC_NPROC = ("auto", "cpu", "gpu")
_UNSET = object()


def flag(option: str) -> str:
    """The command-line spelling of ``option`` (``nproc_per_node`` -> ``--nproc-per-node``)."""
    return "--" + option.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One option's value and where it came from."""

    value: str
    """The value as passed to torchrun."""
    source: str
    """``"argument"`` when the user gave it, else the variable(s) or the device probe it came from."""

    @property
    def given(self) -> bool:
        return self.source == "argument"


@dataclasses.dataclass(frozen=True)
class LocalDevices:
    """What this node can run one process on."""

    kind: str
    """``"cuda"``, ``"npu"`` or ``"cpu"``."""
    count: int
    detail: str
    """How ``count`` was found, for logs."""


@dataclasses.dataclass(frozen=True)
class AutoConfig:
    """The auto-config decision: each option's setting (``None``: left to torchrun) and the new argv."""

    nnodes: Setting | None
    nproc_per_node: Setting | None
    node_rank: Setting | None
    master_addr: Setting | None
    master_port: Setting | None
    devices: LocalDevices | None
    """The node's devices when they were probed (``None`` when the user or the environment decided)."""
    added: tuple[str, ...]
    """The arguments added in front of the user's argv."""
    argv: tuple[str, ...]
    """The torchrun argv to launch with: ``added`` followed by the user's argv."""

    def describe(self) -> str:
        """One line for the launcher's log."""
        parts = []
        for option in OPTIONS:
            setting = getattr(self, option)
            shown = "torchrun default" if setting is None else f"{setting.value} ({setting.source})"
            parts.append(f"{flag(option)[2:]}={shown}")
        added = " ".join(self.added) if self.added else "nothing"
        return f"auto-config: {', '.join(parts)}; added {added}"


def auto_config_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """``argv`` (torchrun's arguments, training script included) with the node options filled in.

    See the module docstring for the sources. Raises :class:`ValueError` when two environment
    variables disagree or a value is invalid.
    """
    return list(resolve_auto_config(argv, env).argv)


def resolve_auto_config(
    argv: Sequence[str], env: Mapping[str, str] | None = None, *, devices: LocalDevices | None = None
) -> AutoConfig:
    """The full decision behind :func:`auto_config_args`; ``devices`` overrides the device probe."""
    env = os.environ if env is None else env
    given = _given_options(argv)
    settings: dict[str, Setting | None] = {o: Setting(str(given[o]), "argument") if o in given else None
                                           for o in OPTIONS}
    standalone = "standalone" in given or env.get("PET_STANDALONE", "0") != "0"
    static = _rdzv_backend(given, env) == "static" and not _rdzv_endpoint(given, env)
    probed: list[LocalDevices] = []
    if settings[NPROC_PER_NODE] is None:
        settings[NPROC_PER_NODE] = _nproc_setting(env, devices, probed)
    if settings[NNODES] is None and not standalone:
        settings[NNODES] = _nnodes_setting(env, settings[NPROC_PER_NODE])
    if static and not standalone:
        for option in (NODE_RANK, MASTER_ADDR, MASTER_PORT):
            if settings[option] is None:
                settings[option] = _env_setting(env, option)
    _validate(settings)
    added = tuple(f"{flag(o)}={s.value}" for o, s in settings.items() if s is not None and not s.given)
    decision = AutoConfig(**settings, devices=probed[0] if probed else None, added=added,
                          argv=added + tuple(argv))
    logger.info("%s", decision.describe())
    return decision


def _given_options(argv: Sequence[str]) -> dict[str, object]:
    """The torchrun options the user gave in ``argv`` (options after the script belong to it)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    for action in parser._actions:  # noqa: SLF001 - defaults would hide what was given
        if action.option_strings:
            action.default = _UNSET

    def error(message: str) -> None:
        raise ValueError(f"Cannot read the torchrun arguments {list(argv)}: {message}. Give the launcher "
                         "options first, then the training script and its arguments.")

    parser.error = error  # type: ignore[method-assign]
    namespace, _ = parser.parse_known_args(list(argv))
    return {dest: value for dest, value in vars(namespace).items() if value is not _UNSET
            and dest not in ("training_script", "training_script_args")}


def _rdzv_backend(given: Mapping[str, object], env: Mapping[str, str]) -> str:
    return str(given.get("rdzv_backend") or env.get("PET_RDZV_BACKEND") or "static")


def _rdzv_endpoint(given: Mapping[str, object], env: Mapping[str, str]) -> str:
    return str(given.get("rdzv_endpoint") or env.get("PET_RDZV_ENDPOINT") or "")


def _agreed(env: Mapping[str, str], names: Sequence[str], canon: Callable[[str, str], object]) -> Setting | None:
    """The value that every set variable of ``names`` agrees on; :class:`ValueError` if they differ.

    ``canon(name, value)`` validates a value and returns the form compared (``"2"`` equals ``"2:2"``).
    """
    found = [(name, env[name].strip()) for name in names if env.get(name, "").strip()]
    if not found:
        return None
    if len({canon(name, value) for name, value in found}) > 1:
        listed = ", ".join(f"{name}={value!r}" for name, value in found)
        raise ValueError(f"The environment disagrees with itself: {listed}. Unset or fix the wrong one, "
                         "or pass the option explicitly (explicit arguments win).")
    return Setting(found[0][1], found[0][0])


def _env_setting(env: Mapping[str, str], option: str) -> Setting | None:
    names = ENV_SOURCES[option]
    if option == NODE_RANK and env.get("WORLD_SIZE", "").strip():
        names = (*names, "RANK")
    return _agreed(env, names, _same if option == MASTER_ADDR else _as_int)


def _same(name: str, value: str) -> str:
    return value


def _as_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer. Fix the variable or pass the option "
                         "explicitly.") from None


def _nnodes_setting(env: Mapping[str, str], nproc: Setting | None) -> Setting | None:
    setting = _agreed(env, ENV_SOURCES[NNODES], lambda name, value: _node_range(value, name))
    world = env.get("WORLD_SIZE", "").strip()
    if setting is None:
        return Setting(world, "WORLD_SIZE") if world else None
    low, high = _node_range(setting.value, setting.source)
    if world and low == high:
        size = _as_int("WORLD_SIZE", world)
        per_node = int(nproc.value) if nproc is not None and nproc.value.isdigit() else None
        if (size not in (low, low * per_node)) if per_node else size % low:
            raise ValueError(
                f"The environment disagrees with itself: {setting.source}={setting.value!r} nodes but "
                f"WORLD_SIZE={world!r}, which is neither the node count nor nodes x processes per node "
                f"({per_node or 'unknown'}). Unset or fix the wrong one, or pass --nnodes explicitly.")
    return setting


def _nproc_setting(
    env: Mapping[str, str], devices: LocalDevices | None, probed: list[LocalDevices]
) -> Setting:
    values = [(n, env[n].strip()) for n in ENV_SOURCES[NPROC_PER_NODE] if env.get(n, "").strip()]
    numeric = [(n, v) for n, v in values if v.isdigit()]
    setting = _agreed(dict(numeric or values), [n for n, _ in numeric or values], lambda _, v: v.lower())
    if setting is not None and (setting.value.isdigit() or setting.value.lower() not in SYMBOLIC_NPROC):
        return setting  # a number, or a device kind torchrun resolves itself (xpu, a private backend)
    mode = setting.value.lower() if setting is not None else "auto"
    found = devices or (cpu_slots() if mode == "cpu" else detect_local_devices())
    probed.append(found)
    source = f"{found.kind}: {found.detail}"
    if setting is None:
        return Setting(str(found.count), source)
    if mode == "gpu" and found.kind == "cpu":
        raise ValueError(f"{setting.source}=gpu but this node shows no GPU ({found.detail}). Check the "
                         "device plugin and drivers, or set the processes per node to a number.")
    return Setting(str(found.count), f"{setting.source}={setting.value} -> {source}")


def _node_range(value: str, source: str) -> tuple[int, int]:
    try:
        low, _, high = value.partition(":")
        bounds = int(low), int(high or low)
    except ValueError:
        bounds = (0, 0)
    if not 0 < bounds[0] <= bounds[1]:
        raise ValueError(f"{source}={value!r} is not a node count: expected N or MIN:MAX with 0 < MIN <= MAX.")
    return bounds


def _validate(settings: Mapping[str, Setting | None]) -> None:
    nproc, rank, port, nnodes = (settings[o] for o in (NPROC_PER_NODE, NODE_RANK, MASTER_PORT, NNODES))
    if nnodes is not None and not nnodes.given:
        _node_range(nnodes.value, nnodes.source)
    if nproc is not None and nproc.value.isdigit() and int(nproc.value) < 1:
        raise ValueError(f"Processes per node from {nproc.source} is {nproc.value}; it must be at least 1.")
    if port is not None and not 0 < int(port.value) < 65536:
        raise ValueError(f"Master port from {port.source} is {port.value}; it must be in 1..65535.")
    if rank is not None and nnodes is not None and not (rank.given and nnodes.given):
        high = _node_range(nnodes.value, nnodes.source)[1]
        if not 0 <= int(rank.value) < high:
            raise ValueError(f"Node rank {rank.value} (from {rank.source}) is outside 0..{high - 1} for "
                             f"{high} nodes (from {nnodes.source}). Fix the variables or pass both options.")


def detect_local_devices() -> LocalDevices:
    """CUDA devices, else NPUs (when ``torch_npu`` imports), else the CPU slots."""
    cuda = torch.cuda.device_count()
    if cuda:
        return LocalDevices("cuda", cuda, "torch.cuda.device_count()")
    npu = _npu_count()
    if npu:
        return LocalDevices("npu", npu, "torch.npu.device_count()")
    return cpu_slots()


def _npu_count() -> int:
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    try:
        importlib.import_module("torch_npu")
        return int(torch.npu.device_count())  # type: ignore[attr-defined]
    except Exception as exc:  # a broken vendor stack must not hide the CPUs
        logger.warning("torch_npu is installed but could not count NPUs (%s); counting CPUs instead.", exc)
        return 0


def cpu_slots(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> LocalDevices:
    """CPUs in this process's affinity mask, capped by the cgroup CPU quota (rounded down, at least 1)."""
    affinity = affinity_cpus()
    quota = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if quota is None or quota >= affinity:
        return LocalDevices("cpu", affinity, f"{affinity} CPUs in the affinity mask")
    count = max(1, math.floor(quota))
    return LocalDevices("cpu", count, f"cgroup CPU quota {quota:g} of {affinity} CPUs in the affinity mask")


def cgroup_cpu_limit(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup or its ancestors; ``None`` if unlimited."""
    limits = [q for q in map(_quota_in, _cgroup_dirs(cgroup_root, proc_cgroup)) if q is not None]
    return min(limits) if limits else None


def _cgroup_dirs(root: str, proc_cgroup: str) -> list[str]:
    """Directories that may hold this process's CPU limits (v2 unified and v1 ``cpu``), innermost first."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return [root]
    dirs = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers and "cpu" not in controllers.split(","):
            continue
        base = os.path.join(root, controllers) if controllers else root
        parts = [p for p in path.split("/") if p]
        dirs += [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]
    return dirs


def _quota_in(directory: str) -> float | None:
    v2 = _read_words(os.path.join(directory, "cpu.max"))
    if v2 and len(v2) == 2 and v2[0] != "max":
        return int(v2[0]) / int(v2[1])
    quota = _read_words(os.path.join(directory, "cpu.cfs_quota_us"))
    period = _read_words(os.path.join(directory, "cpu.cfs_period_us"))
    if quota and period and int(quota[0]) > 0:
        return int(quota[0]) / int(period[0])
    return None


def _read_words(path: str) -> list[str] | None:
    try:
        with open(path) as f:
            return f.read().split()
    except (OSError, ValueError):
        return None


__all__ = ["AutoConfig", "LocalDevices", "Setting", "auto_config_args", "cgroup_cpu_limit", "cpu_slots",
           "detect_local_devices", "resolve_auto_config"]
