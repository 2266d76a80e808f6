"""The saver's torch.save zip writer: the bytes of torch's own writer (CRC-32 on), valid CRCs."""

import io
import os
import shutil
import subprocess
import sys
import zipfile
import zlib

import pytest
import torch

from flashckpt_integrations import Codec, FileSpec
from flashckpt_integrations.core.codecs import torch_file_size
from flashckpt_integrations.core.torchzip import TorchZipWriter, archive_size, crc32_combine

ADDED_AT_END = ("version", ".data/serialization_id")  # what the writers add in finish / write_end_of_file


def _records(saved: bytes) -> list[tuple[str, bytes]]:
    """The records of a torch.save archive (names without the folder), less those added at the end."""
    with zipfile.ZipFile(io.BytesIO(saved)) as archive:
        names = [info.filename.split("/", 1)[1] for info in archive.infolist()]
        return [(name, archive.read(f"archive/{name}")) for name in names if name not in ADDED_AT_END]


def _torch_writer(records: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out, True, 64)  # CRC-32 on, as torch.save
    for name, data in records:
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


def _ours(records: list[tuple[str, bytes]], **kwargs) -> bytes:
    out = io.BytesIO()
    writer = TorchZipWriter(out, **kwargs)
    for name, data in records:
        writer.write_record(name, memoryview(data))
    writer.finish()
    assert writer.size == len(out.getvalue()) == archive_size([(n, len(d)) for n, d in records])
    return out.getvalue()


def _objects():
    torch.manual_seed(0)
    shared = torch.arange(20, dtype=torch.float32)
    yield "one tensor", torch.randn(3, 4)
    yield "empty storage", {"w": torch.randn(5), "empty": torch.zeros(0), "also": torch.empty(0, 3)}
    yield "several storages", {"a": torch.randn(7, 3), "b": torch.ones(2, dtype=torch.bfloat16), "view": shared[3:9],
                               "base": shared, "i": torch.arange(5), "flag": torch.tensor(True)}
    yield "no tensor", {"step": 3, "name": "run", "lr": [0.1, 0.01], "nested": {"x": None}}
    yield "many storages", [torch.full((i % 5,), float(i)) for i in range(40)]  # past two of std's rehashes
    yield "descriptor-like data", torch.frombuffer(bytearray(b"PK\x07\x08" + bytes(range(12))), dtype=torch.uint8)


@pytest.mark.parametrize(("label", "obj"), list(_objects()), ids=[label for label, _ in _objects()])
def test_bytes_equal_torch_writer_with_crc(label, obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    records = _records(buf.getvalue())
    assert records[:4] == [("data.pkl", records[0][1]), (".format_version", b"1"), (".storage_alignment", b"64"),
                           ("byteorder", sys.byteorder.encode())]
    reference = _torch_writer(records)
    assert reference == buf.getvalue()  # torch.save is that writer with those records
    assert _ours(records) == reference  # serialization id included: it is deterministic
    with zipfile.ZipFile(io.BytesIO(reference)) as archive:
        assert archive.testzip() is None


def test_records_torch_save_never_writes():
    records = [("x", b""), ("data/7", b"abc" * 40)]  # no byteorder: both writers add it at the end
    assert _ours(records) == _torch_writer(records)
    writer = TorchZipWriter(io.BytesIO())
    writer.write_record("x", b"")
    with pytest.raises(ValueError, match="already written"):
        writer.write_record("x", b"")
    with pytest.raises(ValueError, match="finish"):
        writer.write_record(".data/serialization_id", b"0")


def test_small_and_streamed_records_give_the_same_bytes():
    records = [("data.pkl", b"\x80\x02."), ("data/0", os.urandom(70_000)), ("data/1", b""), ("data/2", os.urandom(9))]
    crcs = []

    class Sink(io.BytesIO):
        def write_crc32(self, view):
            self.write(view)
            crcs.append(zlib.crc32(view))
            return crcs[-1]

    sink = Sink()
    writer = TorchZipWriter(sink, buffer_below=1000, write_crc32=sink.write_crc32)
    for name, data in records:
        writer.write_record(name, data)
    writer.finish()
    assert crcs == [zlib.crc32(records[1][1])]
    assert sink.getvalue() == _ours(records) == _torch_writer(records)


def test_crc32_combine():
    a, b = os.urandom(1000), os.urandom(77_777)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), 0, 0) == zlib.crc32(a)
    assert crc32_combine(0, zlib.crc32(b), len(b)) == zlib.crc32(bytes(0) + b)


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 4096, 1 << 20, 0xFFFFFFFF, 5 << 30])
def test_torch_file_size_is_the_written_size(nbytes):
    pickle_len = 123
    size = torch_file_size(pickle_len, nbytes)
    records = [("data.pkl", pickle_len), (".format_version", 1), (".storage_alignment", 2),
               ("byteorder", len(sys.byteorder)), ("data/0", nbytes)]
    assert size == archive_size(records)
    if nbytes <= 1 << 20:
        data = [(name, b"\0" * n) for name, n in records]
        assert len(_ours(data)) == size == len(_torch_writer(data))
    else:  # zip64 sizes: the local header, the descriptor and the central directory grow
        assert size > archive_size(records[:4]) + nbytes + 20


def test_checkpoint_file_passes_archive_checkers_and_loads_without_flashckpt(make_checkpointer, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    ck = make_checkpointer()
    assert ck.save(1, state, persist=True).wait(60).committed
    path = tmp_path / "ckpt" / "step-1" / "rank-0.pt"
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        for info in archive.infolist():
            assert info.CRC == zlib.crc32(archive.read(info)) and info.compress_type == zipfile.ZIP_STORED
    buf = io.BytesIO()
    torch.save(state, buf)
    assert data == buf.getvalue()  # the file torch.save writes, byte for byte
    if shutil.which("unzip"):
        result = subprocess.run(["unzip", "-t", str(path)], capture_output=True, text=True)
        assert result.returncode == 0 and "No errors detected" in result.stdout, result.stdout + result.stderr
    torch.save(state, tmp_path / "reference.pt")
    check = (
        "import sys, torch\n"
        "got = torch.load(sys.argv[1], weights_only=True)\n"
        "want = torch.load(sys.argv[2], weights_only=True)\n"
        "assert 'flashckpt_integrations' not in sys.modules\n"
        "def same(a, b):\n"
        "    if isinstance(a, torch.Tensor):\n"
        "        return a.dtype == b.dtype and torch.equal(a, b)\n"
        "    if isinstance(a, dict):\n"
        "        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)\n"
        "    if isinstance(a, (list, tuple)):\n"
        "        return len(a) == len(b) and all(map(same, a, b))\n"
        "    return a == b\n"
        "assert same(got, want) and got['optim']['state'][0]['exp_avg'].abs().sum() > 0\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", check, str(path), str(tmp_path / "reference.pt")],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


def test_parts_file_holds_torch_save_of_each_tensor(make_checkpointer, tmp_path):
    parts = [b"header", torch.randn(100), torch.zeros(0), torch.arange(10)[2:7]]
    ck = make_checkpointer()
    assert ck.save(1, files={"a.distcp": FileSpec(parts, Codec.PARTS)}).wait(60).committed
    data = memoryview((tmp_path / "ckpt" / "step-1" / "a.distcp").read_bytes())
    offset = 0
    for part in parts:
        if isinstance(part, bytes):
            want = part
        else:
            buf = io.BytesIO()
            torch.save(part.contiguous().clone(), buf)
            want = buf.getvalue()
            with zipfile.ZipFile(io.BytesIO(data[offset:offset + len(want)])) as archive:
                assert archive.testzip() is None
        assert data[offset:offset + len(want)] == want
        offset += len(want)
    assert offset == len(data)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FLASHCKPT_TEST_ZIP64"), reason="set FLASHCKPT_TEST_ZIP64=1 (GiBs of CRC-32)")
@pytest.mark.parametrize("sizes", [[0xFFFFFFFE], [0xFFFFFFFF, 100], [3 << 30, 2 << 30, 100]],
                         ids=["u32-1", "u32", "offsets"])
def test_zip64_records_equal_torch_writer(sizes):
    """Records of 4 GiB and headers past 4 GiB (zero pages: nothing is allocated, large writes are summarized)."""
    import mmap

    zeros = mmap.mmap(-1, max(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    class Sink:
        def __init__(self):
            self.stream, self.size = [b""], 0

        def write(self, data):
            view = memoryview(data).cast("B")
            if view.nbytes < 1 << 20:
                self.stream[-1] += bytes(view)
            else:
                self.stream += [(view.nbytes, zlib.crc32(view)), b""]
            self.size += view.nbytes
            return view.nbytes

    records = [("data.pkl", b"\x80\x02K\x01."), ("byteorder", sys.byteorder.encode())]
    records += [(f"data/{i}", n) for i, n in enumerate(sizes)]
    theirs, ours = Sink(), Sink()
    writer = torch._C.PyTorchFileWriter(theirs, True, 64)
    for name, data in records:
        if isinstance(data, int):
            data = torch.frombuffer(zeros, dtype=torch.uint8, count=data).untyped_storage()
        writer.write_record(name, data, len(data) if isinstance(data, bytes) else data.nbytes())
    writer.write_end_of_file()
    writer = TorchZipWriter(ours)
    for name, data in records:
        writer.write_record(name, memoryview(zeros)[:data] if isinstance(data, int) else data)
    writer.finish()
    assert ours.stream == theirs.stream
    assert ours.size == writer.size == archive_size([(n, d if isinstance(d, int) else len(d)) for n, d in records])


def test_zip64_record_of_4_gib_loads_with_torch(tmp_path):
    """A record past 4 GiB (zip64 sizes and offsets) that torch.load reads back, cheaply: the record
    is zeros written as a hole in a sparse file, its CRC-32 combined from a 1 MiB one, never summed."""
    import mmap

    from flashckpt_integrations.core.state import tensor_part_pickle

    nbytes = (4 << 30) + 24
    crc, span = zlib.crc32(bytes(1 << 20)), 1 << 20
    while span < 4 << 30:  # CRC-32 of 2**k MiB of zeros by doubling
        crc, span = crc32_combine(crc, crc, span), span * 2
    crc = crc32_combine(crc, zlib.crc32(bytes(24)), 24)
    zeros = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # never touched: no memory
    path = tmp_path / "big.pt"
    try:
        with open(path, "wb") as f:
            def hole(view):
                f.seek(view.nbytes, os.SEEK_CUR)
                return crc

            writer = TorchZipWriter(f, "big", write_crc32=hole)
            writer.write_record("data.pkl", tensor_part_pickle(torch.empty((nbytes,), dtype=torch.uint8,
                                                                           device="meta")))
            writer.write_record("byteorder", sys.byteorder)
            writer.write_record("data/0", memoryview(zeros))
            writer.finish()
        assert os.path.getsize(path) == writer.size > nbytes
        with zipfile.ZipFile(path) as archive:  # Python's reader: zip64 sizes, offsets and the CRC-32
            info = archive.getinfo("big/data/0")
            assert (info.file_size, info.CRC) == (nbytes, crc)
            assert archive.getinfo("big/.data/serialization_id").header_offset > 4 << 30
        loaded = torch.load(path, mmap=True, weights_only=True)  # torch's reader, without reading the data
        assert loaded.shape == (nbytes,) and loaded.dtype == torch.uint8
        assert int(loaded[0]) == 0 and int(loaded[-1]) == 0
        del loaded
    finally:
        path.unlink(missing_ok=True)  # (the suite's archive check would read all 4 GiB)
