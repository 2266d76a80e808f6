"""Two node savers on loopback, driven as their ranks drive them: snapshots sealed on one node are
copied into the other's replica slots, fetched back into a replacement rank's slot, never torn by
a receiver killed mid-copy, and never handed to (or taken from) a peer that lacks the job's secret."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from flashckpt_integrations import cli
from flashckpt_integrations.core.client import SaverClient, job_key, private_dir, run_dir_for
from flashckpt_integrations.core.protocol import LOG_NAME, SOCKET_NAME
from flashckpt_integrations.core.replication import CHUNK, list_replicas, peers, replica_path
from flashckpt_integrations.core.shm_buffer import HEADER_SIZE, Slot, SlotState
from flashckpt_integrations.core.state import align
from tests.distributed.launch import REPO

pytestmark = pytest.mark.distributed


class Node:
    """One simulated node: its shared-memory directory, its saver process, one rank's client."""

    def __init__(self, base, ckpt: str, job: str, node_rank: int, rank: int, env: dict[str, str] | None = None):
        self.ckpt, self.job, self.node_rank, self.rank = ckpt, job, node_rank, rank
        self.shm = private_dir(os.path.join(base, f"node{node_rank}"))
        self.run_dir = run_dir_for(job, job_key(f"{job}-node{node_rank}")[:8])
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.client: SaverClient | None = None
        self.start()

    @property
    def settings(self) -> dict:
        return {"job": self.job, "node_rank": self.node_rank, "nnodes": 2, "replicas": 1, "shm_dir": self.shm,
                "addr": "127.0.0.1", "node_id": f"node{self.node_rank}",
                "target": {"root": self.ckpt, "storage_options": {}, "storage_factory": None}}

    def start(self) -> None:
        # each offered snapshot is copied on its own (the mode without rounds: these ranks have no slot records)
        env = {**os.environ, "PYTHONPATH": REPO, "FLASHCKPT_SAVER_KEEP_RUN_DIR": "1", "FLASHCKPT_REPLICA_ROUNDS": "0",
               **self.env}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.run_dir, SOCKET_NAME))
        with open(os.path.join(self.run_dir, LOG_NAME), "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "flashckpt_integrations.core.saver", "--run-dir",
                                          self.run_dir, "--idle-exit", "60"], stdout=log, stderr=log, env=env)
        wait_for(lambda: os.path.exists(os.path.join(self.run_dir, SOCKET_NAME)), "the saver to listen")
        self.client = SaverClient(self.run_dir, self.rank, start_timeout=20, hello={"replication": self.settings})
        self.client.connect()

    def ask(self, op: str, **fields) -> dict:
        return self.client.request({"op": op, "rank": self.rank, **fields}).result(30)

    def seal(self, step: int, seq: int, payload: bytes) -> str:
        """Write a snapshot of this node's rank into its slot ``seq % 2`` and offer it to the peers."""
        path = os.path.join(self.shm, f"flashckpt-{os.getuid()}-{self.job}-r{self.rank}-{seq % 2}")
        write_snapshot(path, self.job, self.rank, step, seq, payload)
        assert self.ask("replica_push", slot=path, step=step, seq=seq)["ok"]
        return path

    def log(self) -> str:
        with open(os.path.join(self.run_dir, LOG_NAME)) as f:
            return f.read()

    def kill(self) -> None:
        self.client.close(clean=False)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close(clean=True)
        if self.proc.poll() is None:
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def write_snapshot(path: str, job: str, rank: int, step: int, seq: int, payload: bytes) -> None:
    meta_offset = align(HEADER_SIZE + len(payload))
    meta = json.dumps({"format": 1, "step": step, "rank": rank, "world_size": 2, "job": job, "tag": None,
                       "regions": [[HEADER_SIZE, len(payload)]], "files": []}).encode()
    slot = Slot.create_or_open(path, meta_offset + len(meta))
    try:
        slot.begin_write(step, seq)
        slot.write_blob(HEADER_SIZE, payload)
        slot.write_metadata(step, seq, meta_offset, meta)
        slot.seal()
    finally:
        slot.close()


def used_bytes(path: str) -> tuple[tuple, bytes]:
    slot = Slot.attach(path)
    try:
        h = slot.read_header()
        data = slot.read_bytes(HEADER_SIZE, h.meta_offset + h.meta_len - HEADER_SIZE)
        return (h.state, h.step, h.seq, h.meta_crc), data
    finally:
        slot.close()


def held(node: Node, rank: int) -> dict[int, int]:
    return {r.step: r.seq for r in list_replicas(node.shm, node.job) if r.rank == rank}


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def job(tmp_path, private_shm_dir):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    key = job_key(ckpt)
    nodes: list[Node] = []

    def make(node_rank: int, rank: int, env: dict[str, str] | None = None) -> Node:
        nodes.append(Node(private_shm_dir, ckpt, key, node_rank, rank, env))
        return nodes[-1]

    yield make
    for node in nodes:
        node.stop()
    for node in nodes:
        shutil.rmtree(node.run_dir, ignore_errors=True)


def test_snapshots_are_copied_fetched_back_and_never_torn(job, tmp_path):
    node0 = job(0, rank=0)
    node1 = job(1, rank=1, env={"FLASHCKPT_FAULT": "replica.receive@3"})  # dies receiving its third copy
    secret = tmp_path / "ckpt" / ".flashckpt" / "replica.secret"
    assert oct(secret.stat().st_mode & 0o777) == "0o600"

    source = node0.seal(1, 1, os.urandom(100_000))
    node1.seal(1, 1, os.urandom(50_000))
    wait_for(lambda: held(node1, 0) == {1: 1} and held(node0, 1) == {1: 1}, "each node to hold the other's rank")
    assert used_bytes(replica_path(node1.shm, node1.job, 0, 0)) == used_bytes(source), "a byte-exact copy"
    replica = Slot.attach(replica_path(node1.shm, node1.job, 0, 0))
    assert replica.read_header().persist_req == 0, "a replica is never persisted from"
    replica.close()

    node0.seal(2, 2, os.urandom(200_000))
    wait_for(lambda: held(node1, 0) == {1: 1, 2: 2}, "two replicas of rank 0")

    started = time.monotonic()
    node0.seal(3, 3, os.urandom(3 * CHUNK))  # the copy that node 1's saver is killed in the middle of
    wait_for(lambda: node1.proc.poll() is not None, "node 1's saver to die mid-copy")
    states = sorted(used_bytes(replica_path(node1.shm, node1.job, 0, k))[0][:2] for k in (0, 1))
    assert states == [(SlotState.WRITING, 3), (SlotState.COMPLETE, 2)], "the torn copy went over the older one"
    assert held(node1, 0) == {2: 2}, "the previous replica stays, the torn one is not listed"
    assert node0.ask("ping")["ok"] and time.monotonic() - started < 10, "node 0 never waits on its peer"

    node1.client.close(clean=False)
    node1.env = {}
    node1.start()  # a new saver on node 1: the previous replica is served, node 0 copies step 3 again
    previous = os.path.join(private_dir(str(tmp_path / "replacement")), "previous")
    holder = node1.ask("replica_inventory", rank=0)["replicas"][0]["holder"]
    assert node1.ask("replica_fetch", rank=0, step=2, seq=2, holder=holder, slot=previous)["ok"]
    assert used_bytes(previous) == used_bytes(source.replace("-r0-1", "-r0-0")), "step 2 loads, byte for byte"
    wait_for(lambda: held(node1, 0) == {2: 2, 3: 3}, "the newest snapshot copied to node 1's new saver")
    assert "could not copy rank 0 step 3 to node 1" in node0.log()

    # a replacement rank 0 fetches its newest snapshot from node 1's memory through its own saver
    offers = node0.ask("replica_inventory")["replicas"]
    assert sorted((o["step"], o["holder"]["node_rank"]) for o in offers) == [(2, 1), (3, 1)]
    newest = max(offers, key=lambda o: o["step"])
    target = os.path.join(str(tmp_path / "replacement"), "slot")
    answer = node0.ask("replica_fetch", step=3, seq=3, holder=newest["holder"], slot=target)
    assert answer["ok"] and answer["from_node"] == 1, answer
    assert used_bytes(target) == used_bytes(source), "the fetched copy is the snapshot of step 3, byte for byte"
    fetched = Slot.attach(target)
    header = fetched.read_header()
    assert (header.persist_req, header.persist_done) == (0, 0), "a restored copy is not persisted again"
    fetched.close()
    assert cli.main(["clean", node0.ckpt, "--shm-dir", node1.shm]) == 0
    assert not [n for n in os.listdir(node1.shm) if ".replica-" in n], "flashckpt clean removes replicas too"


class _FakePeer:
    """A TCP server that pretends to be a node's saver, without the job's secret; it records what it got."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        channel = peers.Channel(conn, "client")
        hello = channel.recv()
        self.received += json.dumps(hello).encode()
        channel.send({"ok": True, "nonce": "0" * 32, "mac": "0" * 64})
        conn.settimeout(5)
        with contextlib.suppress(OSError):
            while data := conn.recv(1 << 16):
                self.received += data


def _stranger(port: int, hello: dict, mac: str | None = None) -> list[dict]:
    """Connect as a client that does not hold the secret; return what the saver answered."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    channel = peers.Channel(sock, "saver")
    answers = []
    with contextlib.suppress(ConnectionError, OSError):
        channel.send(hello)
        answers.append(channel.recv())
        if mac is not None:
            channel.send({"mac": mac})
            answers.append(channel.recv())
        channel.send({"op": "inventory"})
        answers.append(channel.recv())
    sock.close()
    return answers


def test_strangers_get_nothing_and_are_logged(job, tmp_path):
    node0 = job(0, rank=0)
    node1 = job(1, rank=1)
    node1.seal(1, 1, os.urandom(10_000))
    wait_for(lambda: held(node0, 1) == {1: 1}, "node 0 to hold rank 1")
    storage = peers.LocalStorage(str(tmp_path / "ckpt"))
    port = peers.read_peer(storage, node0.job, 0).port

    no_secret = _stranger(port, {"hello": peers.PROTOCOL, "job": node0.job, "node": 1, "nonce": "a" * 32}, "f" * 64)
    assert no_secret[0]["ok"] and no_secret[1] == {"ok": False, "error": "not authenticated"}
    assert len(no_secret) == 2, "no answer after the refusal: the connection is closed"
    other_job = _stranger(port, {"hello": peers.PROTOCOL, "job": "another", "node": 1, "nonce": "a" * 32})
    assert other_job == [{"ok": False, "error": "another job"}]
    assert _stranger(port, {"op": "inventory"}) == [{"ok": False, "error": "bad protocol"}]
    with pytest.raises(peers.PeerAuthError):  # the right job, a wrong secret
        peers.connect(peers.read_peer(storage, node0.job, 0), b"x" * 64, node0.job, 1)
    wait_for(lambda: node0.log().count("refused a replication connection") >= 3, "the refusals in the log")
    log = node0.log()
    assert "it did not prove that it holds the job's secret" in log and "it belongs to another job" in log

    # node 1's record now leads to a saver without the secret: node 0 sends it no state
    fake = _FakePeer()
    record = peers.read_peer(storage, node0.job, 1)
    node1.kill()
    peers.publish(storage, peers.PeerRecord(1, "127.0.0.1", fake.port, node0.job, record.pid))
    node0.seal(2, 2, b"secret state " * 1000)
    wait_for(lambda: "did not prove that it belongs to job" in node0.log(), "node 0 to refuse the fake peer")
    time.sleep(0.3)
    assert b"secret state" not in fake.received and b"push" not in fake.received
    assert json.loads(fake.received)["hello"] == peers.PROTOCOL, "only the hello reached it"


def test_a_replica_that_would_exhaust_shared_memory_is_skipped_and_reported(job):
    node0 = job(0, rank=0)
    node1 = job(1, rank=1, env={"FLASHCKPT_REPLICA_SHM_RESERVE": str(1 << 50)})  # more than any /dev/shm
    node0.seal(1, 1, os.urandom(10_000))
    wait_for(lambda: "node 1 skipped the replica of rank 0 step 1: not enough shared memory" in node0.log(),
             "the skip in node 0's log")
    with open(os.path.join(node0.run_dir, "replication.json")) as f:
        outcome = json.load(f)["sent"]["0"]["1"]
    assert outcome["ok"] is False and "not enough shared memory" in outcome["reason"]
    assert "is skipped: not enough shared memory" in node1.log()
    assert held(node1, 0) == {} and not [n for n in os.listdir(node1.shm) if ".replica-" in n]
