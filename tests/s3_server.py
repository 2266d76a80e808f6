"""A throw-away S3-compatible server (moto) for tests.

The server runs in a *separate process* (``python -m moto.server``) bound to
127.0.0.1 on a free port, so it works for code under test that itself spawns
processes (e.g. the background saver): those only need ``storage_options``,
a plain picklable dict.

Usage in a conftest / test module::

    from tests.s3_server import start_s3_server

    @pytest.fixture(scope="session")
    def s3_server(request):
        server = start_s3_server()
        request.addfinalizer(server.stop)
        return server

    def test_upload(s3_server):
        s3_server.make_bucket("ckpts")
        fs = fsspec.filesystem("s3", **s3_server.storage_options)
        fs.pipe("ckpts/a.bin", b"...")

Nothing here talks to anything but 127.0.0.1: fake static credentials and a
fixed region are passed explicitly (so botocore never probes IMDS / config
files), and proxies are disabled both in the client config and via NO_PROXY.

The server is killed by ``stop()``, by an ``atexit`` hook, and (Linux) by the
kernel if the process that started it dies (``PR_SET_PDEATHSIG``; note that
this fires when the *thread* that called ``start_s3_server`` exits, so call it
from the main thread, as pytest fixtures are).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

HOST = "127.0.0.1"
REGION = "us-east-1"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"

# Environment for anything that should talk to the fake server with botocore
# defaults: static credentials, no config/credential files, no IMDS, no proxy.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_UNSET_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
              "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
              "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN")
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")

_LIVE: list[S3Server] = []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _add_no_proxy(env: dict[str, str]) -> None:
    """Make sure 127.0.0.1/localhost bypass any HTTP proxy in ``env`` (in place)."""
    for var in ("NO_PROXY", "no_proxy"):
        items = [x for x in env.get(var, "").split(",") if x.strip()]
        for host in (HOST, "localhost"):
            if host not in items:
                items.append(host)
        env[var] = ",".join(items)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in _UNSET_ENV + _PROXY_VARS:
        env.pop(var, None)
    env.update(FAKE_AWS_ENV)
    _add_no_proxy(env)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except Exception:
        return None


_PRCTL = _load_prctl()  # resolved up front: no dlopen between fork and exec


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the parent


def _http_get(url: str, timeout: float) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never use a proxy
    with opener.open(urllib.request.Request(url, method="GET"), timeout=timeout) as resp:
        return resp.status


class S3Server:
    """Handle on a running moto S3 server (see :func:`start_s3_server`)."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: str):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.endpoint_url = f"http://{HOST}:{port}"
        self.region = REGION
        self.key = ACCESS_KEY
        self.secret = SECRET_KEY
        # Environment for subprocesses that should reach the server through plain
        # botocore defaults (merge into os.environ.copy()).
        self.env = dict(FAKE_AWS_ENV, AWS_ENDPOINT_URL=self.endpoint_url)
        self._client = None

    # -- what tests use -----------------------------------------------------------------

    @property
    def storage_options(self) -> dict[str, Any]:
        """kwargs for ``fsspec.filesystem("s3", **opts)`` / ``s3fs.S3FileSystem(**opts)``.

        A fresh dict each time (callers may mutate it); picklable.
        """
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
            # {} (not None) stops botocore from reading HTTP(S)_PROXY from the environment.
            "config_kwargs": {"proxies": {}, "s3": {"addressing_style": "path"}},
        }

    def client(self):
        """A synchronous botocore S3 client bound to the server (cached)."""
        if self._client is None:
            import botocore.session
            from botocore.config import Config

            session = botocore.session.Session()
            # Static credentials / region given explicitly: no credential-chain lookups.
            self._client = session.create_client(
                "s3",
                region_name=self.region,
                endpoint_url=self.endpoint_url,
                aws_access_key_id=self.key,
                aws_secret_access_key=self.secret,
                config=Config(proxies={}, s3={"addressing_style": "path"},
                              retries={"max_attempts": 2}),
            )
        return self._client

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no-op if it already exists); returns ``name``."""
        c = self.client()
        try:
            c.create_bucket(Bucket=name)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with opener.open(req, timeout=10):
            pass

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Terminate the server process (idempotent)."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        _terminate(self.proc)
        if self in _LIVE:
            _LIVE.remove(self)
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"S3Server(endpoint_url={self.endpoint_url!r}, pid={self.proc.pid})"


def _terminate(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=timeout)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()


def start_s3_server(startup_timeout: float = 60.0, attempts: int = 3) -> S3Server:
    """Start ``python -m moto.server`` on 127.0.0.1:<free port> and wait until it answers.

    Also adds 127.0.0.1/localhost to NO_PROXY in this process, so that clients
    that honour proxy variables never send loopback traffic elsewhere.
    Raises ``RuntimeError`` (with the server log) if it does not come up.
    """
    _add_no_proxy(os.environ)  # type: ignore[arg-type]
    last_err: str | None = None
    for _ in range(attempts):
        port = _free_port()
        fd, log_path = tempfile.mkstemp(prefix="moto-s3-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_child_env(),
                cwd=tempfile.gettempdir(),
                preexec_fn=_set_pdeathsig if _PRCTL is not None else None,
            )
        server = S3Server(proc, port, log_path)
        _LIVE.append(server)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:  # died, e.g. the port got taken: retry on another one
                last_err = f"moto.server exited with {proc.returncode}:\n{server.log()}"
                break
            try:
                _http_get(f"{server.endpoint_url}/moto-api/", timeout=2)
                return server
            except urllib.error.HTTPError:  # any HTTP status means it is serving
                return server
            except OSError:  # URLError / refused / reset: not listening yet
                time.sleep(0.1)
        else:
            last_err = f"moto.server did not answer within {startup_timeout}s:\n{server.log()}"
        server.stop()
    raise RuntimeError(f"could not start moto S3 server: {last_err}")
