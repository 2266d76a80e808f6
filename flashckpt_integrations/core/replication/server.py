"""This saver's side of the peer channel: the listener the job's other savers connect to.

Call order: :class:`Replication <.service.Replication>` makes the TCP listener and hands it to a
:class:`PeerServer` with the job's secret, its replica store and its copy policy; :meth:`PeerServer.start`
starts the accept thread; each connection is authenticated (:func:`.peers.accept`) and then served
on its own thread, one message at a time: ``push``, ``inventory`` and ``fetch`` by :mod:`.transfer`,
any other the copy policy owns (:meth:`.policy.CopyPolicy.handles`) by the policy;
:meth:`PeerServer.close` stops accepting. No torch here.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any

from ..protocol import PeerOp
from .peers import Channel, accept
from .policy import CopyPolicy
from .store import ReplicaStore
from .transfer import SEND_TIMEOUT_S, PushReceiver, inventory, serve_fetch

logger = logging.getLogger(__name__)

MAX_PEER_CONNECTIONS = 64
"""Peer connections served at once; more are refused (and logged)."""


class PeerServer:
    """Serves the job's other savers on ``listener`` (see the module docstring)."""

    def __init__(self, listener: socket.socket, *, secret: bytes, job: str, store: ReplicaStore, run_dir: str,
                 policy: CopyPolicy) -> None:
        self._listener = listener
        self._secret = secret
        self._job = job
        self._store = store
        self._run_dir = run_dir
        self._policy = policy
        self._receiver = PushReceiver(store, run_dir, policy.kept)
        self._connections = threading.BoundedSemaphore(MAX_PEER_CONNECTIONS)
        self._closed = False

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="replica-listen", daemon=True).start()

    def close(self) -> None:
        """Stop accepting; connections end at their next message."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept_loop(self) -> None:
        listener = self._listener
        while not self._closed:
            try:
                sock, address = listener.accept()
            except OSError:
                break
            where = f"{address[0]}:{address[1]}"
            if not self._connections.acquire(blocking=False):
                logger.warning("refused a replication connection from %s: %d are open", where, MAX_PEER_CONNECTIONS)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, where), name="replica-peer", daemon=True).start()

    def _serve(self, sock: socket.socket, address: str) -> None:
        try:
            accepted = accept(sock, address, self._secret, self._job)
            if accepted is None:
                return
            channel, node = accepted
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a peer host that vanished is noticed
            with contextlib.closing(channel):
                while not self._closed:
                    sock.settimeout(None)  # a peer's connection may idle between copies
                    message = channel.recv()
                    sock.settimeout(SEND_TIMEOUT_S)  # a copy that stalls is given up: the previous one stays
                    self._dispatch(channel, message, node)
        except (ConnectionError, OSError, ValueError) as exc:
            logger.debug("replication connection from %s ended: %s", address, exc)
        finally:
            self._connections.release()

    def _dispatch(self, channel: Channel, message: dict[str, Any], node: int) -> None:
        """Serve one message from node ``node`` (answered on ``channel``)."""
        op = message.get("op")
        if op == PeerOp.PUSH:
            self._receiver.receive(channel, message, node)
        elif op == PeerOp.INVENTORY:
            channel.send(inventory(self._store, self._run_dir))
        elif op == PeerOp.FETCH:
            serve_fetch(channel, message, self._store)
        elif self._policy.handles(op):
            channel.send(self._policy.handle(message))
        else:
            channel.send({"ok": False, "error": f"unknown op {op!r}"})
