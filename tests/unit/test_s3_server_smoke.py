"""Smoke test for the moto-backed S3 test server (tests/s3_server.py) driven through s3fs."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import fsspec  # noqa: E402

from tests.s3_server import start_s3_server  # noqa: E402


@pytest.fixture(scope="module")
def s3(request):
    server = start_s3_server()
    request.addfinalizer(server.stop)
    return server


def test_s3_roundtrip(s3):
    assert s3.is_running()
    assert s3.endpoint_url.startswith("http://127.0.0.1:")

    bucket = s3.make_bucket("flashckpt-smoke")
    assert s3.make_bucket(bucket) == bucket  # idempotent

    opts = s3.storage_options
    assert pickle.loads(pickle.dumps(opts)) == opts  # can be shipped to a saver process
    fs = fsspec.filesystem("s3", **opts, skip_instance_cache=True)

    payload = bytes(range(256)) * 4096  # 1 MiB
    with fs.open(f"{bucket}/ckpt/step-1/shard-0.bin", "wb") as f:
        f.write(payload)
    assert fs.cat_file(f"{bucket}/ckpt/step-1/shard-0.bin") == payload
    assert fs.size(f"{bucket}/ckpt/step-1/shard-0.bin") == len(payload)

    fs.pipe_file(f"{bucket}/ckpt/step-1/meta.json", b'{"step": 1}')
    listing = sorted(fs.ls(f"{bucket}/ckpt/step-1", detail=False))
    assert listing == [f"{bucket}/ckpt/step-1/meta.json", f"{bucket}/ckpt/step-1/shard-0.bin"]

    fs.mv(f"{bucket}/ckpt/step-1/shard-0.bin", f"{bucket}/ckpt/step-2/shard-0.bin")
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/ckpt/step-1/shard-0.bin")
    assert fs.cat_file(f"{bucket}/ckpt/step-2/shard-0.bin") == payload

    fs.rm(f"{bucket}/ckpt", recursive=True)
    fs.invalidate_cache()
    assert fs.find(f"{bucket}/ckpt") == []
    assert fs.ls(bucket, detail=False) == []

    # the low-level botocore client sees the same (empty) bucket
    assert s3.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0


def test_stop_kills_server():
    server = start_s3_server()
    try:
        assert server.is_running()
        server.make_bucket("stop-test")
    finally:
        server.stop()
    assert not server.is_running()
    server.stop()  # idempotent
