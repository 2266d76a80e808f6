"""Node ranks grouped by network switch, on torch elastic's own c10d rendezvous.

Neighbouring ranks talk the most (tensor and pipeline groups are made of consecutive ranks), so
they should share a switch. This module is a rendezvous handler, registered with torch's registry
as ``c10d-topology``, that assigns node ranks switch by switch: switches ordered by name, the nodes
under one switch by node name, nodes without a known switch last in torch's own order. Restarts,
``--nnodes MIN:MAX``, scale-down and nodes that rejoin all work as in torch's ``c10d`` backend,
whose state machine it reuses; only the rank assignment at the end of a round differs.

Call order, on every node:

1. :func:`resolve_switch` finds this node's switch: given directly (``--topology-switch`` or
   ``$FLASHCKPT_TOPOLOGY_SWITCH``), looked up in a topology file that maps node names to switches
   (``--topology-file``: ``node switch`` lines, a JSON object, or a Slurm ``topology.conf``), or
   read from a label of this node's Kubernetes Node object (``--topology-key``).
2. :func:`configure` (``flashckpt-run`` calls it) puts the node name and switch into the launch
   config's ``rdzv_configs`` and switches ``--rdzv-backend c10d`` to ``c10d-topology``. With no
   topology information it changes nothing: the launch is exactly torch's. :func:`register` adds
   the backend to torch's registry in the launcher's process. There is deliberately no
   ``torchrun.handlers`` entry point: torch would import this package in every process that imports
   torch elastic, the stock loaders of users who never asked for it included.
3. Each :meth:`TopologyRendezvousHandler.next_rendezvous` first publishes this node's place
   (switch and node name) in the rendezvous store under its torch node descriptor, then joins the
   round as torch does. The node that completes the round (torch lets exactly one node's state
   win) assigns every participant's rank from the published places, so every node reads the same
   order from the shared state, and a node that rejoins after a restart gets the rank its place
   has in the new round. Node rank 0 logs the order once per round (``last_order``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _DistributedRendezvousOpExecutor,
    _get_timeout,
)

from ..errors import MissingDependencyError

logger = logging.getLogger(__name__)

BACKEND = "c10d-topology"
"""The rendezvous backend name (``--rdzv-backend``)."""
BASE_BACKEND = "c10d"
KEY_PREFIX = "flashckpt.topology"
"""Store keys of the published places: ``<prefix>/<run id>/<torch node descriptor>``."""

NODE_NAME_ENV = "FLASHCKPT_NODE_NAME"
"""This node's name (on Kubernetes: the Node's, from the downward API's ``spec.nodeName``)."""
SWITCH_ENV = "FLASHCKPT_TOPOLOGY_SWITCH"
FILE_ENV = "FLASHCKPT_TOPOLOGY_FILE"
KEY_ENV = "FLASHCKPT_TOPOLOGY_KEY"

# rdzv_configs keys (``--rdzv-conf``) the handler reads
CONF_NODE_NAME, CONF_SWITCH, CONF_FILE, CONF_KEY = "node_name", "switch", "topology_file", "topology_key"

_Node = TypeVar("_Node")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a node sits: its switch (``None`` when unknown) and its name."""

    switch: str | None
    node: str

    def to_json(self) -> bytes:
        return json.dumps({"switch": self.switch, "node": self.node}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Place:
        value = json.loads(data)
        return cls(switch=value.get("switch") or None, node=str(value.get("node", "")))


def node_name(explicit: str | None = None) -> str:
    """This node's name: ``explicit``, else ``$FLASHCKPT_NODE_NAME``, else the host name."""
    return explicit or os.environ.get(NODE_NAME_ENV) or socket.gethostname()


# --- where the switch comes from ----------------------------------------------------------------


def expand_hostlist(expression: str) -> list[str]:
    """Slurm's host list syntax: ``gpu[01-03,07],login1`` -> gpu01, gpu02, gpu03, gpu07, login1."""
    names: list[str] = []
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", expression):
        match = re.match(r"^(.*?)\[([^\]]*)\](.*)$", part)
        if match is None:
            names.append(part)
            continue
        prefix, ranges, rest = match.groups()
        for item in ranges.split(","):
            start, _, end = item.partition("-")
            if not start.isdigit() or (end and not end.isdigit()):
                raise ValueError(f"Cannot read the host range [{ranges}] in {expression!r}: write it as "
                                 "name[1-4,7] (digits only).")
            for i in range(int(start), int(end or start) + 1):
                names.extend(f"{prefix}{i:0{len(start)}d}{tail}" for tail in expand_hostlist(rest) or [""])
    return names


def parse_topology(text: str, source: str = "topology file") -> dict[str, str]:
    """Node name -> switch, from a JSON object, a Slurm ``topology.conf`` (leaf switches, those with
    ``Nodes=``), or ``node switch`` lines (``#`` starts a comment)."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"The {source} looks like JSON but does not parse: {exc}.") from exc
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f'The {source} must map node names to switch names, like {{"node-1": "switch-a"}}.')
        return {str(k): v for k, v in data.items()}
    mapping: dict[str, str] = {}
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    slurm = any("switchname=" in line.lower() for line in lines)
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        if slurm:
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            fields = {k.lower(): v for k, v in fields.items()}
            if "switchname" in fields and "nodes" in fields:
                mapping.update(dict.fromkeys(expand_hostlist(fields["nodes"]), fields["switchname"]))
            continue
        words = line.split()
        if len(words) != 2:
            raise ValueError(f"Line {number} of the {source} is {line!r}; each line names a node and its switch, "
                             "like 'node-1 switch-a'.")
        mapping[words[0]] = words[1]
    return mapping


@functools.lru_cache(maxsize=8)
def read_topology_file(path: str) -> dict[str, str]:
    with open(path) as f:
        return parse_topology(f.read(), f"topology file {path}")


def _lookup(mapping: Mapping[str, str], node: str) -> str | None:
    for name in (node, node.split(".", 1)[0]):
        if name in mapping:
            return mapping[name]
    short = {k.split(".", 1)[0]: v for k, v in mapping.items()}
    return short.get(node.split(".", 1)[0])


def kubernetes_label(node: str, key: str) -> str | None:
    """The value of label ``key`` on Kubernetes Node ``node`` (needs ``get`` on nodes)."""
    from .node_failure import kubernetes_core_api

    labels = kubernetes_core_api().read_node(node, _request_timeout=10).metadata.labels or {}
    return labels.get(key)


def resolve_switch(node: str, *, switch: str | None = None, topology_file: str | None = None,
                   topology_key: str | None = None) -> str | None:
    """This node's switch from the first source given; ``None`` (and a warning) when that source
    does not know the node or the Kubernetes API does not answer. A topology file that cannot be
    read, or no Kubernetes credentials, raise ``ValueError``; no ``kubernetes`` package raises
    :class:`~flashckpt_integrations.errors.MissingDependencyError`."""
    if switch:
        return switch
    if topology_file:
        try:
            found = _lookup(read_topology_file(os.path.abspath(topology_file)), node)
        except OSError as exc:
            raise ValueError(f"Cannot read the topology file {topology_file}: {exc}.") from exc
        if found is None:
            logger.warning("The topology file %s does not list node %r; its ranks come after the known switches'. "
                           "Add the node, or set its name with --node-name / $%s.", topology_file, node, NODE_NAME_ENV)
        return found
    if topology_key:
        try:
            found = kubernetes_label(node, topology_key)
        except (MissingDependencyError, ValueError):  # no client, no credentials: fix the setup
            raise
        except Exception as exc:  # the API did not answer: the job runs anyway, in torch's order for this node
            logger.warning("Cannot read label %s of Kubernetes node %r (%s: %s); its ranks come after the known "
                           "switches'. The pod needs $%s from the downward API (spec.nodeName) and RBAC 'get' on "
                           "nodes.", topology_key, node, type(exc).__name__, exc, NODE_NAME_ENV)
            return None
        if found is None:
            logger.warning("Kubernetes node %r has no label %s; its ranks come after the known switches'.",
                           node, topology_key)
        return found
    return None


# --- the order ----------------------------------------------------------------------------------


def order_nodes(places: Mapping[_Node, Place | None]) -> list[_Node]:
    """The rank order: by switch name, then node name, then torch's own order (the keys sort);
    nodes with no known switch come last, in torch's order. With no switch known at all this is
    exactly torch's order, ``sorted(places)``."""
    def key(node: _Node) -> tuple[Any, ...]:
        place = places[node]
        if place is None or place.switch is None:
            return (1, "", "", node)
        return (0, place.switch, place.node, node)

    return sorted(places, key=key)


@dataclasses.dataclass(frozen=True)
class NodeOrder:
    """The node ranks of one rendezvous round, with each node's place."""

    round: int
    ranks: tuple[tuple[int, Place | None], ...]

    def __str__(self) -> str:
        groups: dict[str | None, list[str]] = {}
        for rank, place in self.ranks:
            name = f" ({place.node})" if place is not None and place.node else ""
            groups.setdefault(place.switch if place else None, []).append(f"{rank}{name}")
        text = "; ".join(f"switch {switch} -> node ranks {', '.join(ranks)}" for switch, ranks in groups.items()
                         if switch is not None)
        if None in groups:
            text += ("; " if text else "") + f"no known switch -> node ranks {', '.join(groups[None])}"
        return f"round {self.round}: {text}"


def _place_key(run_id: str, node: object) -> str:
    return f"{KEY_PREFIX}/{run_id}/{node!r}"


def read_places(store: Store, run_id: str, nodes: Iterable[_Node]) -> dict[_Node, Place | None]:
    """The published place of each node (``None`` for a node that published none)."""
    nodes = list(nodes)
    keys = [_place_key(run_id, node) for node in nodes]
    if keys and store.check(keys) and hasattr(store, "multi_get"):
        values = store.multi_get(keys)
    else:
        values = [store.get(key) if store.check([key]) else None for key in keys]
    places: dict[_Node, Place | None] = {}
    for node, value in zip(nodes, values):
        try:
            places[node] = Place.from_json(value) if value else None
        except (ValueError, AttributeError):
            places[node] = None
    return places


# --- the handler --------------------------------------------------------------------------------


class _TopologyOpExecutor(_DistributedRendezvousOpExecutor):
    """torch's rendezvous operations, with ranks assigned in switch order when a round completes."""

    def __init__(self, *args: Any, places: Callable[[Iterable[Any]], Mapping[Any, Place | None]]) -> None:
        super().__init__(*args)
        self._places = places

    def _mark_rendezvous_complete(self) -> None:
        super()._mark_rendezvous_complete()
        participants = self._state.participants
        try:
            order = order_nodes(self._places(participants))
        except Exception as exc:  # the store is the rendezvous' own: then torch's order is kept
            logger.warning("Cannot read the nodes' switches (%s: %s); keeping torch's node order.",
                           type(exc).__name__, exc)
            return
        for rank, node in enumerate(order):
            participants[node] = rank


class TopologyRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic (c10d) rendezvous handler that orders node ranks by switch.

    Build it with :func:`create_handler` (what the registry calls); set :attr:`place` before the
    first :meth:`next_rendezvous`.
    """

    place: Place | None = None
    last_order: NodeOrder | None = None
    """The order of the latest round this node joined as node rank 0 (``None`` on the others)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._op_executor = _TopologyOpExecutor(self._this_node, self._state_holder, self._settings,
                                                places=self._read_places)

    def get_backend(self) -> str:
        return BACKEND

    def _read_places(self, nodes: Iterable[Any]) -> dict[Any, Place | None]:
        return read_places(self._store, self._settings.run_id, nodes)

    def next_rendezvous(self) -> RendezvousInfo:
        if self.place is not None:
            self._store.set(_place_key(self._settings.run_id, self._this_node), self.place.to_json())
        info = super().next_rendezvous()
        self.last_order = None
        if info.rank == 0:
            state = self._state_holder.state
            ranked = sorted(state.participants.items(), key=lambda item: item[1])
            try:
                places = self._read_places(node for node, _ in ranked)
                self.last_order = NodeOrder(state.round, tuple((rank, places[node]) for node, rank in ranked))
                logger.info("Node ranks by switch, %s", self.last_order)
            except Exception as exc:  # only the log line is lost
                logger.warning("Cannot describe the node order: %s: %s", type(exc).__name__, exc)
        return info


def create_handler(params: RendezvousParameters) -> TopologyRendezvousHandler:
    """The registry's creator for ``c10d-topology`` (the parameters of torch's ``c10d``, plus
    ``node_name``, ``switch``, ``topology_file`` and ``topology_key``)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    backend, store = create_backend(params)
    timeout = RendezvousTimeout(*(_get_timeout(params, name) for name in ("join", "last_call", "close", "heartbeat")))
    handler = TopologyRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr, timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )
    node = node_name(params.get(CONF_NODE_NAME))
    if CONF_SWITCH in params.config:  # resolved already (by configure): empty when unknown
        switch = params.config[CONF_SWITCH] or None
    else:
        switch = resolve_switch(node, switch=os.environ.get(SWITCH_ENV),
                                topology_file=params.get(CONF_FILE) or os.environ.get(FILE_ENV),
                                topology_key=params.get(CONF_KEY) or os.environ.get(KEY_ENV))
    handler.place = Place(switch=switch, node=node)
    return handler


def create_rendezvous_handler(params: Any) -> Any:
    """The registry's creator for ``c10d-topology``: :func:`create_handler`."""
    return create_handler(params)


def register() -> None:
    """Register ``c10d-topology`` with torch's rendezvous registry (again is fine)."""
    handler_registry.register(BACKEND, create_rendezvous_handler)


def configure(config: Any, *, node: str | None = None, switch: str | None = None, topology_file: str | None = None,
              topology_key: str | None = None) -> Place | None:
    """Make ``config`` (a ``LaunchConfig``) rendezvous with ``c10d-topology`` when any topology
    source is given (arguments, else the ``$FLASHCKPT_TOPOLOGY_*`` variables); return this node's
    place, or ``None`` (and leave ``config`` as it is) when there is no topology information.

    Raises ``ValueError`` when the rendezvous backend cannot order ranks (``static`` fixes them
    with ``--node-rank``, ``etcd`` is not wrapped) or a source cannot be used (see
    :func:`resolve_switch`).
    """
    switch = switch or os.environ.get(SWITCH_ENV)
    topology_file = topology_file or os.environ.get(FILE_ENV)
    topology_key = topology_key or os.environ.get(KEY_ENV)
    if not (switch or topology_file or topology_key):
        return None
    if config.rdzv_backend not in (BASE_BACKEND, BACKEND):
        raise ValueError(f"Ordering node ranks by switch needs the c10d rendezvous, but the rendezvous backend is "
                         f"{config.rdzv_backend!r}" + (" (the node rank comes from --node-rank)"
                                                       if config.rdzv_backend == "static" else "") +
                         ". Launch with --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB, or drop the "
                         "--topology-* options.")
    name = node_name(node)
    place = Place(switch=resolve_switch(name, switch=switch, topology_file=topology_file, topology_key=topology_key),
                  node=name)
    register()
    config.rdzv_backend = BACKEND
    config.rdzv_configs = {**config.rdzv_configs, CONF_NODE_NAME: name, CONF_SWITCH: place.switch or ""}
    return place
