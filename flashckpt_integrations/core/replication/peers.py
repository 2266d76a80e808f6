"""Finding the job's other savers, and proving to each other that both belong to the job.

Savers replicate memory snapshots to each other over TCP (:mod:`flashckpt_integrations.core.replication`).
They find each other through what the job already shares, its checkpoint storage, and authenticate every
connection with a per-job secret. Call order, on a saver with replication on:

1. :func:`job_secret` (storage): ``$FLASHCKPT_REPLICA_SECRET`` when the launcher set one, else
   ``.flashckpt/replica.secret`` in the checkpoint directory, created exclusively by the first
   saver (mode 0600 on a local or shared file system: only the job's user can read it).
2. :func:`publish` its :class:`PeerRecord` (``.flashckpt/peers/<job>/<node rank>.json``: host,
   port, node rank, pid); :func:`read_peers` lists the others. A record of a saver that died stays
   until its node's next saver overwrites it: a connection to it fails or is refused, nothing more.
3. :func:`placement`: which node ranks hold the replicas of a node's ranks (node k -> k+1 .. k+R).
4. :func:`connect` (client side) and :func:`accept` (server side) run the handshake: a mutual
   HMAC-SHA256 challenge-response over both sides' fresh nonces with a key derived from the secret
   and the job key. The server refuses a peer of another job, or one that cannot answer, and logs
   it; a client that cannot verify the server sends it nothing. Then both use the :class:`Channel`:
   length-prefixed JSON messages, each optionally followed by raw bytes it announces. A saver (and
   ``flashckpt ls``) opens every channel through one :class:`PeerDialer`, which holds the job, the
   secret and the node rank it speaks as.

Connections are authenticated, not encrypted: run replication on the cluster's private network.
No torch or numpy here (the saver imports this module).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import struct
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from ... import knobs
from ...errors import FlashCkptError
from ..layout import META_DIR
from ..storage import LocalStorage, Storage, create_exclusive, write_bytes

logger = logging.getLogger(__name__)

SECRET_FILE = f"{META_DIR}/replica.secret"
PEERS_DIR = f"{META_DIR}/peers"
PROTOCOL = "flashckpt-replica/1"
HANDSHAKE_TIMEOUT_S = 10.0
MAX_MESSAGE = 64 << 20
"""Largest JSON message accepted from an authenticated peer (an inventory of many ranks)."""
MAX_UNAUTHENTICATED = 4096
"""Largest message accepted before the peer proved it belongs to the job."""
_LEN = struct.Struct(">I")


class PeerAuthError(FlashCkptError):
    """A peer did not prove that it belongs to this job (wrong or missing secret, another job)."""


# --- the per-job secret -----------------------------------------------------------------------------


def job_secret(storage: Storage, *, create: bool = True) -> bytes | None:
    """The job's replication secret (see the module docstring); None when there is none and
    ``create`` is false. A secret file that others can read is refused (it proves nothing)."""
    env = knobs.get(knobs.REPLICA_SECRET)
    if env:
        return env.encode()
    if isinstance(storage, LocalStorage):
        return _local_secret(os.path.join(storage.root, SECRET_FILE), create)
    if not storage.exists(SECRET_FILE):
        if not create:
            return None
        create_exclusive(storage, SECRET_FILE, secrets.token_hex(32).encode())
    data = storage.read(SECRET_FILE).strip()
    if len(data) < 32:
        raise PeerAuthError(f"{storage.url}/{SECRET_FILE} holds {len(data)} bytes, not a secret; remove it")
    return data


def _local_secret(path: str, create: bool) -> bytes | None:
    """Read (or create: a 0600 temporary linked into place, so a reader never sees it half written)."""
    if create and not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PeerAuthError(
                f"{path} is owned by uid {st.st_uid} with mode {oct(stat.S_IMODE(st.st_mode))}; it must be "
                f"uid {os.getuid()}'s with mode 0600, or it proves nothing. Remove it (the next saver makes a "
                f"new one) or set ${knobs.REPLICA_SECRET}")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < 32:
        raise PeerAuthError(f"{path} holds {len(data)} bytes, not a secret; remove it")
    return data


def _key(secret: bytes, job: str) -> bytes:
    return hmac.new(secret, f"{PROTOCOL}|{job}".encode(), hashlib.sha256).digest()


def _mac(key: bytes, role: str, client_nonce: str, server_nonce: str) -> str:
    return hmac.new(key, f"{role}|{client_nonce}|{server_nonce}".encode(), hashlib.sha256).hexdigest()


# --- peer records -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerRecord:
    """Where one node's saver accepts replication connections."""

    node_rank: int
    host: str
    port: int
    job: str
    pid: int = 0
    node_id: str = ""
    time: float = 0.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerRecord:
        return cls(int(data["node_rank"]), str(data["host"]), int(data["port"]), str(data["job"]),
                   int(data.get("pid", 0)), str(data.get("node_id", "")), float(data.get("time", 0.0)))


def peer_path(job: str, node_rank: int) -> str:
    return f"{PEERS_DIR}/{job}/{node_rank}.json"


def publish(storage: Storage, record: PeerRecord) -> None:
    write_bytes(storage, peer_path(record.job, record.node_rank), json.dumps(asdict(record)).encode())


def unpublish(storage: Storage, record: PeerRecord) -> None:
    """Remove ``record`` if it is still the node's (a newer saver may have replaced it)."""
    with contextlib.suppress(Exception):
        current = read_peer(storage, record.job, record.node_rank)
        if current is not None and current.pid == record.pid and current.port == record.port:
            storage.remove(peer_path(record.job, record.node_rank))


def read_peer(storage: Storage, job: str, node_rank: int) -> PeerRecord | None:
    path = peer_path(job, node_rank)
    try:
        return PeerRecord.from_dict(json.loads(storage.read(path))) if storage.exists(path) else None
    except (ValueError, KeyError, TypeError, FlashCkptError) as exc:
        logger.warning("ignoring the unreadable peer record %s: %s", path, exc)
        return None


def read_peers(storage: Storage, job: str) -> dict[int, PeerRecord]:
    """Every node's published saver of ``job``, by node rank."""
    found = {}
    for name in storage.list(f"{PEERS_DIR}/{job}"):
        stem = name.removesuffix(".json")
        if name.endswith(".json") and stem.isdigit():
            record = read_peer(storage, job, int(stem))
            if record is not None:
                found[record.node_rank] = record
    return found


def placement(node_rank: int, nnodes: int, replicas: int) -> list[int]:
    """The node ranks that hold the replicas of ``node_rank``'s ranks: the next ``replicas`` nodes
    in ring order (never the node itself; fewer when the job has fewer other nodes)."""
    return [(node_rank + k) % nnodes for k in range(1, min(replicas, nnodes - 1) + 1)]


def local_address(toward: str | None) -> str:
    """The address of this host that peers reach: ``$FLASHCKPT_REPLICA_ADDR``, else the interface
    that routes toward ``toward`` (the job's MASTER_ADDR). A loopback answer counts only when
    ``toward`` is itself a loopback address (every node on this host, as in tests); otherwise the
    host's outward interface is taken (the master's name may resolve to 127.0.1.1 on its own host)."""
    explicit = knobs.get(knobs.REPLICA_ADDR)
    if explicit:
        return explicit
    found = _route_source(toward) if toward else None
    if found is not None and (not found.startswith("127.") or _is_loopback(toward)):
        return found
    for candidate in (_route_source("192.0.2.1"), _host_address()):  # a documentation address: never contacted
        if candidate is not None and not candidate.startswith("127."):
            return candidate
    return found or "127.0.0.1"


def _route_source(host: str) -> str | None:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]
    return None


def _host_address() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


# --- framing and the handshake ----------------------------------------------------------------------


class Channel:
    """One authenticated connection: length-prefixed JSON messages, raw bytes where announced."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        self.sock.sendall(_LEN.pack(len(data)) + data)

    def recv(self, limit: int = MAX_MESSAGE) -> dict[str, Any]:
        (length,) = _LEN.unpack(self.recv_exact(_LEN.size))
        if length > limit:
            raise ConnectionError(f"{self.peer} sent a message of {length} bytes (at most {limit} accepted)")
        message = json.loads(self.recv_exact(length))
        if not isinstance(message, dict):
            raise ConnectionError(f"{self.peer} sent a message that is not an object")
        return message

    def recv_exact(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError(f"{self.peer} closed the connection")
            got += n

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def connect(record: PeerRecord, secret: bytes, job: str, node_rank: int, *, timeout: float = 30.0,
            connect_timeout: float = 3.0) -> Channel:
    """Open an authenticated channel to ``record``'s saver; :class:`PeerAuthError` when it does not
    prove it belongs to ``job`` (nothing is sent to it then), ``OSError`` when it is unreachable."""
    sock = socket.create_connection((record.host, record.port), timeout=connect_timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    channel = Channel(sock, record.address)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        nonce = secrets.token_hex(16)
        channel.send({"hello": PROTOCOL, "job": job, "node": node_rank, "nonce": nonce})
        answer = channel.recv(MAX_UNAUTHENTICATED)
        if not answer.get("ok"):
            raise PeerAuthError(f"the saver at {record.address} refused this node: {answer.get('error')}")
        key = _key(secret, job)
        server_nonce = str(answer.get("nonce", ""))
        if len(server_nonce) < 32 or not hmac.compare_digest(str(answer.get("mac", "")),
                                                             _mac(key, "server", nonce, server_nonce)):
            raise PeerAuthError(f"the saver at {record.address} did not prove that it belongs to job {job} "
                                "(another job's, or it lacks the job's secret); nothing was sent to it")
        channel.send({"mac": _mac(key, "client", nonce, server_nonce)})
        final = channel.recv(MAX_UNAUTHENTICATED)
        if not final.get("ok"):
            raise PeerAuthError(f"the saver at {record.address} refused this node: {final.get('error')}")
        sock.settimeout(timeout)
        return channel
    except BaseException:
        channel.close()
        raise


@dataclass(frozen=True)
class PeerDialer:
    """How one saver (or ``flashckpt ls``) reaches the job's savers: their records on ``storage``
    and authenticated channels to them, speaking as node ``node_rank`` (-1: not a node's saver)."""

    storage: Storage
    job: str
    secret: bytes = field(repr=False)
    node_rank: int = -1

    def records(self) -> dict[int, PeerRecord]:
        """Every node's published saver of the job, by node rank."""
        return read_peers(self.storage, self.job)

    def connect(self, record: PeerRecord, *, timeout: float) -> Channel:
        """An authenticated channel to ``record``'s saver (see :func:`connect`)."""
        return connect(record, self.secret, self.job, self.node_rank, timeout=timeout)

    def connect_node(self, node_rank: int, *, timeout: float) -> Channel:
        """An authenticated channel to node ``node_rank``'s published saver; ``ConnectionError``
        when that node has published none."""
        record = read_peer(self.storage, self.job, node_rank)
        if record is None:
            raise ConnectionError(f"node {node_rank} has published no saver")
        return self.connect(record, timeout=timeout)


def accept(sock: socket.socket, address: str, secret: bytes, job: str) -> tuple[Channel, int] | None:
    """Server side of the handshake on an accepted socket: the channel and the peer's node rank,
    or None (the connection is closed and the refusal logged)."""
    channel = Channel(sock, address)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        hello = channel.recv(MAX_UNAUTHENTICATED)
        if hello.get("hello") != PROTOCOL:
            return _refuse(channel, f"it does not speak {PROTOCOL}", "bad protocol")
        if hello.get("job") != job:
            return _refuse(channel, f"it belongs to another job ({hello.get('job')!r}, this is {job!r})",
                           "another job")
        client_nonce = str(hello.get("nonce", ""))
        if len(client_nonce) < 32:
            return _refuse(channel, "its challenge is too short", "bad challenge")
        key = _key(secret, job)
        server_nonce = secrets.token_hex(16)
        channel.send({"ok": True, "nonce": server_nonce, "mac": _mac(key, "server", client_nonce, server_nonce)})
        answer = channel.recv(MAX_UNAUTHENTICATED)
        if not hmac.compare_digest(str(answer.get("mac", "")), _mac(key, "client", client_nonce, server_nonce)):
            return _refuse(channel, "it did not prove that it holds the job's secret", "not authenticated")
        channel.send({"ok": True})
        sock.settimeout(None)
        return channel, int(hello.get("node", -1))
    except (OSError, ValueError, ConnectionError) as exc:
        logger.warning("refused a replication connection from %s: the handshake failed (%s)", address, exc)
        channel.close()
        return None


def _refuse(channel: Channel, why: str, short: str) -> None:
    logger.warning("refused a replication connection from %s: %s; nothing is sent to it", channel.peer, why)
    with contextlib.suppress(OSError):
        channel.send({"ok": False, "error": short})
    time.sleep(0.05)  # let the answer leave before the close
    channel.close()
    return None
