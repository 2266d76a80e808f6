"""Shared test helpers: state builders, comparisons, storages that fail or stall on purpose.

The storage factories are imported by the saver process through ``storage_factory``
("tests.helpers:SlowStorage"), so they read their knobs from the environment that the saver
inherits from the rank that started it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import torch

from flashckpt_integrations.core.layout import Layout
from flashckpt_integrations.core.storage import LocalStorage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
]


def rich_state(seed: int = 0) -> dict[str, Any]:
    """A state that exercises every kind of value a checkpoint may hold."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, generator=g)
    matrix = torch.randn(8, 6, generator=g)
    tensors = {str(d).replace("torch.", ""): (torch.randn(5, 3, generator=g) * 50).to(d) for d in ALL_DTYPES}
    return {
        "tensors": tensors,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "transposed": matrix.t(),
        "strided": matrix[:, ::2],
        "base": base,
        "view_a": base[3:10],
        "view_b": base[5:20].view(3, 5),
        "nested": collections.OrderedDict(
            layers=[{"w": torch.randn(4, 4, generator=g), "b": torch.zeros(4)}, (torch.ones(2), "tag", 7)]
        ),
        "args": argparse.Namespace(lr=0.1, betas=(0.9, 0.95), name="run"),
        "values": {"int": 12, "float": float("inf"), "nan": float("nan"), "str": "héllo", "none": None,
                   "bool": True, "bytes": b"\x00\x01", "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
                   "set": {1, 2}, "tuple": (1, (2, 3)), 5: "int key"},
    }


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Bit-exact equality of nested states (NaN-safe, dtype- and layout-aware)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), where
        assert a.storage_offset() == b.storage_offset(), where
        raw_a, raw_b = (t.reshape(-1).contiguous().view(torch.uint8) for t in (a, b))
        assert torch.equal(raw_a, raw_b), where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, argparse.Namespace):
        assert vars(a) == vars(b), where
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


SAVE_LINE = re.compile(r"\[RANK (\d+)\] flashckpt: (.+?) of step (\d+) (\w+) (.*) \(training held ([0-9.]+)s\)$")
"""The one INFO line an adapter logs per framework-level save (``adapters._common.log_save``)."""


def save_lines(messages: list[str], call: str) -> list[tuple[int, int, str, str, float]]:
    """``(rank, step, status, where, held_s)`` of every save line of ``call`` among log ``messages``."""
    out = []
    for message in messages:
        match = SAVE_LINE.search(message)
        if match is not None and match.group(2) == call:
            rank, _, step, status, where, held = match.groups()
            out.append((int(rank), int(step), status, where, float(held)))
    return out


def marker_names(marker_dir: Any) -> list[str]:
    """The names in a step's marker directory, with each save id left out (``rank-0.a3.done`` -> ``rank-0.done``)."""
    import re

    return sorted(re.sub(r"^(rank-\d+)\.[^.]+\.(done|failed)$", r"\1.\2", name) for name in os.listdir(marker_dir))


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class SlowStorage(LocalStorage):
    """Local storage whose data-file writes (staged ones too) sleep ``$FLASHCKPT_TEST_WRITE_DELAY``
    seconds first; markers and records are written at once."""

    def __init__(self, root: str, **_: Any) -> None:
        super().__init__(root)
        self.delay = float(os.environ.get("FLASHCKPT_TEST_WRITE_DELAY", "1"))

    def open_write(self, path: str):  # type: ignore[override]
        if Layout.is_data_file(path):
            time.sleep(self.delay)
        return super().open_write(path)


class CountingStorage(LocalStorage):
    """Local storage that counts the bytes read from data files, by every read path it has, in
    the class-level :attr:`data_bytes`: under the path for positioned reads (``open_ranges``),
    under ``"read:<path>"`` for whole-file and stream reads (``read``, ``open_read``)."""

    data_bytes: dict[str, int] = {}

    def __init__(self, root: str, **_: Any) -> None:
        super().__init__(root)

    def _count(self, key: str, n: int) -> None:
        if Layout.is_data_file(key.removeprefix("read:")):
            CountingStorage.data_bytes[key] = CountingStorage.data_bytes.get(key, 0) + n

    def read(self, path: str) -> bytes:
        data = super().read(path)
        self._count(f"read:{path}", len(data))
        return data

    @contextlib.contextmanager
    def open_read(self, path: str):  # type: ignore[override]
        with super().open_read(path) as f:
            yield _CountingFile(f, lambda n: self._count(f"read:{path}", n))

    def open_ranges(self, path: str):  # type: ignore[override]
        ranges = super().open_ranges(path)
        readinto = ranges.readinto

        def counted(offset: int, view: memoryview) -> int:
            n = readinto(offset, view)
            self._count(path, n)
            return n

        ranges.readinto = counted
        return ranges


class _CountingFile:
    def __init__(self, f: Any, count: Any) -> None:
        self._f, self._count = f, count

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._count(len(data))
        return data

    def readinto(self, view: Any) -> int:
        n = self._f.readinto(view) or 0
        self._count(n)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class FailingStorage(LocalStorage):
    """Local storage whose data-file writes fail like a full disk."""

    def open_write(self, path: str):  # type: ignore[override]
        if not path.startswith(".flashckpt") and os.path.exists(os.path.join(self.root, "FAIL")):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return super().open_write(path)


def run_python(
    code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a new process of the same job)."""
    full_env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def saver_pids(run_dir: str) -> list[int]:
    """Pids of saver processes serving ``run_dir``."""
    out = subprocess.run(["pgrep", "-f", f"flashckpt_integrations.core.saver --run-dir {run_dir}"],
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def savers_with_shm_dir(shm_dir: str) -> list[int]:
    """Pids of the savers started with ``FLASHCKPT_SHM_DIR=shm_dir`` (a test's or a trial's own)."""
    found = []
    for pid in saver_pids(""):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if f"FLASHCKPT_SHM_DIR={shm_dir}".encode() in f.read().split(b"\0"):
                found.append(pid)
    return found


def kill_savers(run_dir: str) -> None:
    """SIGKILL the savers of ``run_dir`` and wait until they are gone (a process with large mappings
    takes a moment to exit after SIGKILL)."""
    for pid in saver_pids(run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while saver_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.02)


def raising_fsspec_storage(url: str, **options: Any):
    """An fsspec file system that raises on data-file writes once ``<root>/FAIL`` exists."""
    from fsspec.implementations.local import LocalFileSystem

    from flashckpt_integrations.core.storage import FsspecStorage

    class RaisingFileSystem(LocalFileSystem):
        def _open(self, path, mode="rb", **kwargs):
            if "w" in mode and ".flashckpt" not in path and os.path.exists(os.path.join(url, "FAIL")):
                raise ConnectionError(f"injected failure writing {path}")
            return super()._open(path, mode=mode, **kwargs)

    return FsspecStorage(url, fs=RaisingFileSystem(), **options)


def storage_refused_after_start(url: str, **options: Any) -> LocalStorage:
    """Local storage that refuses to open once ``<root>/DENY`` exists (credentials that expired
    after the trainer opened its storage, a service that went away)."""
    root = url[len("file://"):] if url.startswith("file://") else url
    if os.path.exists(os.path.join(root, "DENY")):
        raise PermissionError(errno.EACCES, "the storage service refused the connection (injected)", url)
    return LocalStorage(root)


def exit_without_teardown(code: int) -> None:
    """End a worker script without interpreter teardown, where gloo threads still running can
    abort it (SIGABRT) after a finished run: the process group destroyed, output flushed."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_slots(ckpt_dir: Any, rank: int) -> dict[int, str]:
    """``{step: path}`` of the complete memory snapshots a rank of the job in ``ckpt_dir`` left behind."""
    from flashckpt_integrations.core.client import job_key

    prefix = f"flashckpt-{os.getuid()}-{job_key(str(ckpt_dir))}-r{rank}-"
    shm = os.environ.get("FLASHCKPT_SHM_DIR", "/dev/shm")
    return {step: path for _, step, path in complete_slots(shm) if os.path.basename(path).startswith(prefix)}


def complete_slots(shm_dir: str) -> list[tuple[int, int, str]]:
    """``(rank, step, path)`` of every complete snapshot in ``shm_dir`` (a test's private one)."""
    from flashckpt_integrations.core.shm_buffer import attach_complete

    found = []
    for name in sorted(os.listdir(shm_dir)):
        path = os.path.join(shm_dir, name)
        attached = attach_complete(path) if os.path.isfile(path) else None
        if attached is not None:
            slot, header = attached
            try:
                found.append((slot.read_metadata(header)["rank"], header.step, slot.path))
            finally:
                slot.close()
    return found


def flip_slot_byte(path: str, which: str = "region") -> None:
    """Flip one byte in the middle of a complete slot's first tensor region (or its first blob), as a
    stray write or a bad DIMM would; the slot's header and metadata stay intact. First waits until
    the snapshot's checksums are written (by its trainer, or by the saver once that trainer died),
    so that the flip lands after them, as a stray write does."""
    import time

    from flashckpt_integrations.core import verify
    from flashckpt_integrations.core.shm_buffer import Slot

    deadline = time.monotonic() + 30
    while verify.check_slot(path)["status"] != "ok":
        assert time.monotonic() < deadline, f"{path}: {verify.check_slot(path)}"
        time.sleep(0.02)
    slot = Slot.attach(path)
    try:
        meta = slot.read_metadata(slot.read_header())
        offset, nbytes = meta["regions"][0] if which == "region" else meta["files"][0]["blob"]
        slot.buffer[offset + nbytes // 2] ^= 0x10
    finally:
        slot.close()


def flip_file_byte(path: Any, at: float = 0.5) -> None:
    """Flip one byte of a file on storage, at ``at`` of its length."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(int(size * at))
        byte = f.read(1)
        f.seek(int(size * at))
        f.write(bytes([byte[0] ^ 0x10]))
