"""A restore from storage reads each committed byte once and decodes it straight into the live tensors."""

import os

import pytest
import torch

from flashckpt_integrations.core import reading
from flashckpt_integrations.core.storage import LocalStorage
from tests.helpers import CountingStorage, assert_same, flip_file_byte


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.weight": torch.randn(256, 1024, generator=gen) for i in range(24)}  # 24 MiB
    model["embed.weight"] = model["layer0.weight"]  # tied: one storage, two views
    return {"model": model, "opt": {"exp_avg": [torch.randn(4096, generator=gen).half() for _ in range(3)],
                                    "step": torch.tensor(seed)}, "epoch": seed, "empty": torch.zeros(0)}


def _live(state: dict) -> dict:
    live = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "opt": {"exp_avg": [torch.empty_like(t) for t in state["opt"]["exp_avg"]],
                    "step": torch.tensor(-1)}, "epoch": -1, "empty": torch.zeros(0)}
    live["model"]["embed.weight"] = live["model"]["layer0.weight"]
    return live


def test_a_restore_from_storage_reads_each_byte_once_into_the_live_tensors(make_checkpointer, tmp_path):
    ck = make_checkpointer(storage_factory="tests.helpers:CountingStorage")
    first, second = _state(1), _state(2)
    assert ck.save(1, first).wait(60).committed
    assert ck.save(2, second).wait(60).committed
    files = {f"step-{s}/rank-0.pt": os.path.getsize(tmp_path / "ckpt" / f"step-{s}" / "rank-0.pt") for s in (1, 2)}
    live = _live(second)
    pointers = {k: v.data_ptr() for k, v in live["model"].items()}
    CountingStorage.data_bytes.clear()
    result = ck.load(prefer_memory=False, target=live)
    assert result.source == "storage" and result.step == 2
    assert CountingStorage.data_bytes == {"step-2/rank-0.pt": files["step-2/rank-0.pt"]}, "once, by ranges"
    assert_same(second, result.state)
    assert {k: v.data_ptr() for k, v in live["model"].items()} == pointers
    assert result.state["model"]["layer3.weight"] is live["model"]["layer3.weight"]
    assert torch.equal(live["model"]["layer5.weight"], second["model"]["layer5.weight"])
    assert live["model"]["embed.weight"] is live["model"]["layer0.weight"]

    flip_file_byte(tmp_path / "ckpt" / "step-2" / "rank-0.pt", at=0.6)  # inside a storage read in place
    live["model"]["layer0.weight"].fill_(7)
    CountingStorage.data_bytes.clear()
    result = ck.load(prefer_memory=False, target=live)
    assert result.step == 1 and result.fallbacks, result
    assert_same(first, result.state)  # the bad file's bytes, already in place, were overwritten
    assert torch.equal(live["model"]["layer20.weight"], first["model"]["layer20.weight"])
    assert CountingStorage.data_bytes == files
    os.unlink(tmp_path / "ckpt" / "step-2" / "rank-0.pt")  # (not a valid zip any more)


def test_the_one_pass_reader_decodes_torch_save_files_through_any_backend(tmp_path):
    """A file ``torch.save`` wrote, read through the O_DIRECT ranges of local storage and through
    a backend that only has ``open_read``: same values, tied storages still tied; a truncated
    file and a changed byte are refused."""
    state = _state(3)
    torch.save(state, tmp_path / "plain.pt")
    data = (tmp_path / "plain.pt").read_bytes()
    expected = {"size": len(data), "crc32": __import__("zlib").crc32(data)}

    class OpenReadOnly:
        url = str(tmp_path)

        def open_read(self, path):
            return LocalStorage(str(tmp_path)).open_read(path)

    for storage in (LocalStorage(str(tmp_path)), OpenReadOnly()):
        with reading.open_ranges(storage, "plain.pt") as ranges:
            obj = reading.read_torch(ranges, "plain.pt", expected=expected)
        assert_same(state, obj)
        assert obj["model"]["embed.weight"].data_ptr() == obj["model"]["layer0.weight"].data_ptr()

    (tmp_path / "short.pt").write_bytes(data[:-1000])
    with pytest.raises(Exception, match="size"), reading.open_ranges(LocalStorage(str(tmp_path)), "short.pt") as r:
        reading.read_torch(r, "short.pt", expected=expected)
    changed = bytearray(data)
    changed[len(changed) // 3] ^= 0x10
    (tmp_path / "changed.pt").write_bytes(bytes(changed))
    with pytest.raises(Exception, match="checksum"), \
            reading.open_ranges(LocalStorage(str(tmp_path)), "changed.pt") as r:
        reading.read_torch(r, "changed.pt", expected=expected)
    os.unlink(tmp_path / "changed.pt")


def test_a_read_refused_under_o_direct_is_made_buffered(tmp_path):
    """A file system may take ``O_DIRECT`` at open and refuse it on a read (EINVAL, as the kernel
    answers an unaligned one): the file is read buffered from then on, with the same bytes."""
    data = os.urandom(8 << 20)
    (tmp_path / "f.bin").write_bytes(data)
    with LocalStorage(str(tmp_path)).open_ranges("f.bin") as ranges:
        if not ranges.direct:
            from flashckpt_integrations._utils import pagecache

            fd = os.open(tmp_path / "f.bin", os.O_RDONLY)
            os.fsync(fd)
            pagecache.drop(fd)
            os.close(fd)
    with LocalStorage(str(tmp_path)).open_ranges("f.bin") as ranges:
        if not ranges.direct:
            pytest.skip("this file system does not take O_DIRECT")
        out = bytearray(1000)
        assert ranges.readinto(4097, memoryview(out)) == 1000  # unaligned: EINVAL under O_DIRECT
        assert bytes(out) == data[4097:5097] and not ranges.direct


def test_an_object_store_read_is_ranged_requests_in_parallel_each_byte_once():
    """fsspec back ends: a read is split into ranged requests of ``PART`` bytes, several in flight at
    once (here a file system without an event loop: on threads), covering the file exactly once."""
    import threading
    import time
    import uuid

    from fsspec.implementations.memory import MemoryFileSystem

    from flashckpt_integrations.core.storage import FsspecRanges, FsspecStorage, write_bytes

    requests, active, most = [], [0], [0]
    lock = threading.Lock()

    class SlowMemory(MemoryFileSystem):  # a real fsspec file system whose ranged reads take 20 ms
        def cat_file(self, path, start=None, end=None, **kwargs):
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
                requests.append((start, end))
            time.sleep(0.02)
            try:
                return super().cat_file(path, start=start, end=end, **kwargs)
            finally:
                with lock:
                    active[0] -= 1

    storage = FsspecStorage(f"memory://flashckpt-ranges-{uuid.uuid4().hex}", fs=SlowMemory())
    data = os.urandom((21 << 20) + 12345)
    write_bytes(storage, "f.bin", data)
    requests.clear()
    with reading.open_ranges(storage, "f.bin") as ranges:
        assert isinstance(ranges, FsspecRanges)
        got = reading.read_bytes(ranges, "f.bin")
    assert bytes(got) == data
    spans = sorted(requests)
    assert spans[0][0] == 0 and spans[-1][1] == len(data), spans
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans  # contiguous, no byte twice
    assert all(end - start <= FsspecRanges.PART for start, end in spans)
    assert most[0] > 1, "the ranged requests never overlapped"
