"""The replication package's shape: its face re-exports the implementation objects, the copy policy
is picked in one place from ``$FLASHCKPT_REPLICA_ROUNDS``, the wire names between savers stay what
they are, and its modules import each other without a circle (and without torch)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from types import SimpleNamespace

from flashckpt_integrations.core import protocol, replication
from flashckpt_integrations.core.replication import peers, service, status, store, stream, transfer
from flashckpt_integrations.core.replication.eager import Eager
from flashckpt_integrations.core.replication.policy import CopyPolicy
from flashckpt_integrations.core.replication.rounds import Rounds


def test_the_face_reexports_the_implementation_objects():
    assert replication.Replication is service.Replication and replication.SURVEY_CACHE_S is service.SURVEY_CACHE_S
    assert replication.STATUS_FILE == status.STATUS_FILE == "replication.json"
    assert replication.ReplicaStore is store.ReplicaStore and replication.verify is store.verify
    assert replication.list_replicas is store.list_replicas and replication.replica_paths is store.replica_paths
    assert replication.replica_path is store.replica_path and replication.CHUNK is stream.CHUNK
    assert replication.placement is peers.placement and replication.peers is peers
    assert replication.survey is transfer.survey
    assert all(hasattr(replication, name) for name in replication.__all__)


def test_the_copy_policy_is_rounds_unless_the_knob_turns_them_off(monkeypatch):
    context = SimpleNamespace(run_dir="", store=None, dialer=None, status=None)
    settings = SimpleNamespace(node_rank=0, nnodes=2, replicas=1)
    monkeypatch.delenv("FLASHCKPT_REPLICA_ROUNDS", raising=False)
    chosen = service.copy_policy(context, settings)
    assert isinstance(chosen, Rounds) and isinstance(chosen, CopyPolicy) and not chosen.wants_pushes
    assert chosen.handles(protocol.PeerOp.ROUND_HELD) and not chosen.handles(protocol.PeerOp.PUSH)
    monkeypatch.setenv("FLASHCKPT_REPLICA_ROUNDS", "0")
    chosen = service.copy_policy(context, settings)
    assert isinstance(chosen, Eager) and isinstance(chosen, CopyPolicy) and chosen.wants_pushes
    assert chosen.kept() is None and not chosen.handles(protocol.PeerOp.ROUND_HELD)


def test_the_wire_names_between_savers_are_unchanged():
    assert set(protocol.PEER_OPS) == {"push", "inventory", "fetch", "round_held", "round_snap", "round_send",
                                      "round_kept"}
    assert protocol.ROUND_OPS == ("round_held", "round_snap", "round_send", "round_kept")
    assert peers.PROTOCOL == "flashckpt-replica/1"


def test_the_package_has_no_import_circle_and_imports_no_torch():
    package = pathlib.Path(replication.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        inner = [node for func in ast.walk(tree) if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for node in ast.walk(func) if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not inner, f"{path.name} imports inside a function"
        graph[path.stem] = {(node.module or alias.name).split(".")[0] for node in tree.body
                            if isinstance(node, ast.ImportFrom) and node.level == 1 for alias in node.names}
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"import circle: {' -> '.join((*trail, name))}"
        if name not in done:
            for dep in graph.get(name, ()):
                visit(dep, (*trail, name))
            done.add(name)

    for name in graph:
        visit(name, ())
    code = ("import sys\nsys.modules['torch'] = None\nsys.modules['numpy'] = None\n"
            "import flashckpt_integrations.core.replication, flashckpt_integrations.core.saver\nprint('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
