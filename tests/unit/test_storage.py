"""Storage backends, their failures, and object storage on a real S3-compatible server."""

import contextlib
import io
import os
import random
import subprocess

import pytest
import torch

from flashckpt_integrations import Storage, register_storage
from flashckpt_integrations.core.storage import (
    FsspecStorage,
    LocalStorage,
    _DirectWrite,
    storage_from_url,
    write_bytes,
)
from tests.s3_server import start_s3_server


@pytest.fixture(scope="module")
def s3_server():
    server = start_s3_server()
    yield server
    server.stop()


@contextlib.contextmanager
def tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_storage_protocol(kind, tmp_path):
    storage = LocalStorage(str(tmp_path)) if kind == "local" else FsspecStorage(f"memory://proto-{os.getpid()}")
    assert isinstance(storage, Storage)
    write_bytes(storage, "a/b/file.bin", b"12345")
    assert storage.exists("a/b/file.bin") and storage.read("a/b/file.bin") == b"12345"
    assert storage.size("a/b/file.bin") == 5 and storage.list("a/b") == ["file.bin"]
    assert storage.list("missing") == []
    storage.rename("a/b", "a/c")
    assert storage.read("a/c/file.bin") == b"12345" and not storage.exists("a/b")
    storage.remove("a")
    assert not storage.exists("a/c/file.bin")
    storage.remove("a")  # removing a missing path is fine


def test_local_write_is_atomic(tmp_path):
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(RuntimeError), storage.open_write("x.bin") as f:
        f.write(b"partial")
        raise RuntimeError("crash while writing")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("direct", ["1", "0"])
def test_local_writes_every_size_and_chunking(direct, tmp_path, monkeypatch):
    """Files written through O_DIRECT (default where the file system takes it) or the page cache hold
    exactly the bytes written, whatever the sizes of the writes, and end at their size."""
    monkeypatch.setenv("FLASHCKPT_DIRECT_IO", direct)
    storage, rnd = LocalStorage(str(tmp_path)), random.Random(7)
    buffer = _DirectWrite.BUFFER
    for size in (0, 1, 4095, 4096, 4097, buffer, buffer + 3, 3 * buffer + 5000):
        data = os.urandom(size)
        with storage.open_write(f"f{size}") as f:
            assert isinstance(f, _DirectWrite) == (direct == "1" and _DirectWrite._supported.get(
                os.stat(tmp_path).st_dev, False))
            done = 0
            while done < size:
                n = rnd.choice([1, 7, 100, 5000, 1 << 20, buffer + 9])
                f.write(memoryview(data)[done:done + n])
                done += n
        assert os.path.getsize(tmp_path / f"f{size}") == size and storage.read(f"f{size}") == data
    # a flush in the middle (not what open_write does, but allowed): what follows is appended after it
    with storage.open_write("flushed") as f:
        f.write(b"a" * 5000)
        f.flush()
        f.write(b"b" * (buffer + 1))
    assert storage.read("flushed") == b"a" * 5000 + b"b" * (buffer + 1)


def test_registry_and_factory_strings(tmp_path):
    seen = []

    def factory(url, **options):
        seen.append((url, options))
        return LocalStorage(str(tmp_path))

    register_storage("myfs", factory)
    assert isinstance(storage_from_url("myfs://bucket/x", {"k": 1}), LocalStorage)
    assert seen == [("myfs://bucket/x", {"k": 1})]
    assert isinstance(storage_from_url(str(tmp_path), factory="tests.helpers:SlowStorage"), LocalStorage)
    with pytest.raises(ValueError, match="bare name"):
        register_storage("s3://", factory)


def test_s3_save_commit_load_and_retention(s3_server, make_checkpointer):
    from flashckpt_integrations import RetentionPolicy

    bucket = s3_server.make_bucket("ckpts")
    url = f"s3://{bucket}/run-1"
    ck = make_checkpointer(url, storage_options=s3_server.storage_options, retention=RetentionPolicy(keep_last=1))
    state = {"w": torch.randn(300, 100), "step": 1}
    assert ck.save(1, state).wait(60).committed
    state2 = {"w": torch.randn(300, 100), "step": 2}
    assert ck.save(2, state2).wait(60).committed
    loaded = ck.load(prefer_memory=False)
    assert (loaded.step, loaded.source) == (2, "storage")
    assert torch.equal(loaded.state["w"], state2["w"])
    fs = FsspecStorage(url, **s3_server.storage_options)
    deadline = __import__("time").monotonic() + 20
    while fs.exists("step-1") and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.1)
    assert not fs.exists("step-1") and fs.exists("step-2/rank-0.pt")
    assert fs.read("latest").strip() == b"2"


def test_read_only_storage_is_reported_and_the_last_commit_stays(tmp_path, make_checkpointer, caplog):
    with tmpfs(tmp_path / "mnt", "64m") as mnt:
        ck = make_checkpointer(mnt / "ckpt")
        assert ck.save(1, {"w": torch.ones(10)}).wait(60).committed
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        result = ck.save(2, {"w": torch.full((10,), 2.0)})
        outcome = result.wait(60)
        assert not outcome.committed and "Read-only" in outcome.error
        assert any("could not persist step 2" in r.message for r in caplog.records)
        # training goes on: memory saves still work, the last commit is intact
        assert ck.save(3, {"w": torch.full((10,), 3.0)}, persist=False).ok
        assert ck.committed_steps() == [1]
        assert torch.equal(ck.load(1, prefer_memory=False).state["w"], torch.ones(10))
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        ck.close()


def test_full_storage_is_reported_and_the_last_commit_stays(tmp_path, make_checkpointer):
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        ck = make_checkpointer(mnt / "ckpt")
        assert ck.save(1, {"w": torch.ones(1000)}).wait(60).committed
        outcome = ck.save(2, {"w": torch.ones(4 << 20)}).wait(60)
        assert not outcome.committed and "full" in outcome.error
        assert ck.committed_steps() == [1]
        assert not [n for n in os.listdir(mnt / "ckpt" / "step-2")] if (mnt / "ckpt" / "step-2").exists() else True
        assert torch.equal(ck.load(1, prefer_memory=False).state["w"], torch.ones(1000))
        ck.close()


def test_raising_fsspec_filesystem_is_reported(tmp_path, make_checkpointer):
    root = tmp_path / "ckpt"
    ck = make_checkpointer(root, storage_factory="tests.helpers:raising_fsspec_storage")
    assert ck.save(1, {"w": torch.ones(3)}).wait(60).committed
    (root / "FAIL").write_text("")
    outcome = ck.save(2, {"w": torch.zeros(3)}).wait(60)
    assert not outcome.committed and "injected failure" in outcome.error
    os.unlink(root / "FAIL")
    assert ck.save(3, {"w": torch.zeros(3)}).wait(60).committed
    assert ck.committed_steps() == [1, 3]


def test_stale_temporaries_of_written_files_are_removed(tmp_path):
    from flashckpt_integrations.core.storage import LocalStorage, remove_stale_temporaries

    storage = LocalStorage(str(tmp_path))
    for name in ("d/x.pt", "d/.x.pt.tmp-1a2b3c4d", "d/x.pt.tmp-00ff00ff", "d/.y.pt.tmp-5e6f7a8b", "e/.z.tmp-1"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"-")
    remove_stale_temporaries(storage, ["d/x.pt", "e/z"])
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [".y.pt.tmp-5e6f7a8b", "x.pt"]
    assert not list((tmp_path / "e").iterdir())


def test_s3_identity_is_created_once_and_a_committed_step_is_superseded(s3_server, make_checkpointer):
    from flashckpt_integrations.core.lineage import ensure_identity
    from flashckpt_integrations.core.storage import create_exclusive

    url = f"s3://{s3_server.make_bucket('lineage')}/run"
    fs = FsspecStorage(url, **s3_server.storage_options)
    assert create_exclusive(fs, "x/once", b"first") and not create_exclusive(fs, "x/once", b"second")
    assert fs.read("x/once") == b"first"  # a conditional put: the second writer does not overwrite
    assert len({ensure_identity(FsspecStorage(url, **s3_server.storage_options)) for _ in range(3)}) == 1
    ck = make_checkpointer(url, storage_options=s3_server.storage_options)
    assert ck.save(3, {"w": torch.ones(100)}).wait(60).committed
    assert ck.save(3, {"w": torch.full((100,), 2.0)}).wait(60).committed
    assert torch.equal(ck.load(3, prefer_memory=False).state["w"], torch.full((100,), 2.0))
    assert torch.equal(torch.load(io.BytesIO(fs.read("step-3/rank-0.pt")))["w"], torch.full((100,), 2.0))


def test_s3_ranged_reads_return_the_object_exactly(s3_server):
    """On s3fs (asynchronous) the parts go out together through ``cat_ranges``; reads at any offset,
    across parts and past the end, return the object's bytes."""
    from flashckpt_integrations.core import reading
    from flashckpt_integrations.core.storage import FsspecRanges

    storage = FsspecStorage(f"s3://{s3_server.make_bucket('ranges')}/run", **s3_server.storage_options)
    data = os.urandom((9 << 20) + 777)
    write_bytes(storage, "f.bin", data)
    with reading.open_ranges(storage, "f.bin") as ranges:
        assert isinstance(ranges, FsspecRanges) and ranges.fs.async_impl and ranges.size == len(data)
        assert bytes(reading.read_bytes(ranges, "f.bin")) == data
        out = bytearray(FsspecRanges.PART * 2 + 10)
        n = ranges.readinto(len(data) - FsspecRanges.PART - 5, memoryview(out))
        assert n == FsspecRanges.PART + 5 and bytes(out[:n]) == data[-n:]
