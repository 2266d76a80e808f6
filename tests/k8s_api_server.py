"""A loopback stand-in for the Kubernetes API server, for tests: Node GET and PATCH, nothing else.

The real ``kubernetes`` client talks to it through a kubeconfig (plain HTTP on 127.0.0.1, a bearer
token)::

    with KubernetesApiTestServer({"host-a": {"example.com/switch": "sw1"}}) as server:
        env["KUBECONFIG"] = server.write_kubeconfig(tmp_path / "kubeconfig")
        ...
        server.patches("host-a")      # the bodies of the PATCH requests for that node
        server.nodes["host-a"]        # the Node object as patched

PATCH takes ``application/merge-patch+json`` and ``application/strategic-merge-patch+json`` (both
merged as RFC 7386; no list merge keys are needed for the fields a cordon sets) and
``application/json-patch+json`` (add, replace, remove). Errors come back as the API server's
``Status`` objects.
"""

from __future__ import annotations

import copy
import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOKEN = "test-token"
NODES_PATH = "/api/v1/nodes/"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict, operations: list[dict]) -> dict:
    """RFC 6902, the operations a client sends for labels and spec fields."""
    result = copy.deepcopy(target)
    for op in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        holder = result
        for part in parents:
            holder = holder[part]
        if op["op"] in ("add", "replace"):
            if op["op"] == "replace" and last not in holder:
                raise KeyError(op["path"])
            holder[last] = op["value"]
        elif op["op"] == "remove":
            del holder[last]
        else:
            raise ValueError(f"unsupported op {op['op']}")
    return result


def node_object(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"kind": "Node", "apiVersion": "v1",
            "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1",
                         "creationTimestamp": "2024-01-01T00:00:00Z",
                         "labels": {"kubernetes.io/hostname": name, **labels}},
            "spec": {}, "status": {}}


class KubernetesApiTestServer:
    """Serves Node objects on 127.0.0.1 from a thread; records every request."""

    def __init__(self, nodes: dict[str, dict[str, str]]) -> None:
        self.nodes = {name: node_object(name, labels) for name, labels in nodes.items()}
        self.requests: list[tuple[str, str, str | None, Any]] = []
        """(method, path, content type, parsed body) of every request, in order."""
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="k8s-api-test-server", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> KubernetesApiTestServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def write_kubeconfig(self, path: Any) -> str:
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
                  "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                  "users": [{"name": "test", "user": {"token": TOKEN}}],
                  "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        return str(path)

    def patches(self, node: str) -> list[Any]:
        with self._lock:
            return [body for method, path, _, body in self.requests if method == "PATCH" and path == NODES_PATH + node]

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                  "message": message, "reason": reason, "code": code})

            def _node(self) -> str | None:
                path = self.path.split("?", 1)[0]
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._status(401, "Unauthorized", "Unauthorized")
                    return None
                if not path.startswith(NODES_PATH) or "/" in path[len(NODES_PATH):]:
                    self._status(404, "NotFound", f"the server could not find the requested resource ({path})")
                    return None
                name = path[len(NODES_PATH):]
                if name not in server.nodes:
                    self._status(404, "NotFound", f'nodes "{name}" not found')
                    return None
                return name

            def do_GET(self) -> None:
                with server._lock:
                    server.requests.append(("GET", self.path.split("?", 1)[0], None, None))
                    name = self._node()
                    if name is not None:
                        self._send(200, server.nodes[name])

            def do_PATCH(self) -> None:
                kind = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip()
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with server._lock:
                    try:
                        body = json.loads(raw or b"null")
                    except ValueError:
                        body = raw.decode(errors="replace")
                    server.requests.append(("PATCH", self.path.split("?", 1)[0], kind, body))
                    name = self._node()
                    if name is None:
                        return
                    node = server.nodes[name]
                    try:
                        if kind in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                            patched = merge_patch(node, body)
                        elif kind == "application/json-patch+json":
                            patched = json_patch(node, body)
                        else:
                            self._status(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType",
                                         f"the body of the request was in an unknown format ({kind})")
                            return
                    except (KeyError, TypeError, ValueError, IndexError) as exc:
                        self._status(422, "Invalid", f"the patch does not apply: {exc!r}")
                        return
                    patched["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                    server.nodes[name] = patched
                    self._send(200, patched)

        return Handler
