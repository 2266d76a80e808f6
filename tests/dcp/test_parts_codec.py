"""The parts codec writes what torch.distributed.checkpoint's FileSystemWriter writes, item by item."""

import io
import zipfile

import pytest
import torch

from flashckpt_integrations import Codec, FileSpec
from flashckpt_integrations.core.codecs import parts_layout
from flashckpt_integrations.core.state import tensor_part_pickle

TENSORS = [
    torch.randn(3, 4), torch.randn(6, 4)[1:3], torch.randn(4, 6).t(), torch.tensor(2.5), torch.zeros(0, 3),
    torch.zeros(5).to(torch.float8_e5m2), torch.ones(2, dtype=torch.bool), torch.randn(3, requires_grad=True),
    torch.arange(7, dtype=torch.int64), torch.randn(2, 2, dtype=torch.complex64), torch.randn(5).bfloat16(),
]


@pytest.mark.parametrize("tensor", TENSORS, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{t.stride()}")
def test_tensor_part_is_the_torch_save_of_the_tensor_alone(tensor):
    buf = io.BytesIO()
    torch.save(tensor.detach().contiguous().clone(), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as archive:
        assert archive.read("archive/data.pkl") == tensor_part_pickle(tensor)
    assert parts_layout([tensor]) == [(0, len(buf.getvalue()))]


def test_parts_file_round_trip_through_memory_and_storage(make_checkpointer, tmp_path):
    parts = [b"header", torch.randn(100), b"", torch.arange(10)[2:7], torch.zeros(3, dtype=torch.float8_e4m3fn),
             torch.randn(4, 6).t()]
    ck = make_checkpointer()
    assert ck.save(1, files={"a.distcp": FileSpec(parts, Codec.PARTS), "empty.distcp": FileSpec([], Codec.PARTS)}
                   ).wait(60).committed
    data = (tmp_path / "ckpt" / "step-1" / "a.distcp").read_bytes()
    assert (tmp_path / "ckpt" / "step-1" / "empty.distcp").read_bytes() == b""
    layout = parts_layout(parts)
    assert sum(length for _, length in layout) == len(data)
    for part, (offset, length) in zip(parts, layout):
        if isinstance(part, bytes):
            assert data[offset:offset + length] == part
        else:
            loaded = torch.load(io.BytesIO(data[offset:offset + length]), weights_only=True)
            assert loaded.dtype == part.dtype and torch.equal(loaded.view(torch.uint8), part.contiguous().view(
                torch.uint8))
    loaded = ck.load(1)
    assert loaded.source == "memory"
    for got, part in zip(loaded.files["a.distcp"], parts):
        if isinstance(part, bytes):
            assert got == part
        else:
            assert torch.equal(got.view(torch.uint8), part.contiguous().view(torch.uint8))
    assert ck.load(1, prefer_memory=False).files["a.distcp"] == data
