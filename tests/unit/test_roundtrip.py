"""Every kind of value round-trips bit-exactly through memory and through storage."""

import os
import zlib

import pytest
import torch

from flashckpt_integrations import Codec, FileSpec
from tests.helpers import assert_same, rich_state, shares_storage


def test_memory_round_trip_is_bit_exact_and_keeps_sharing(make_checkpointer):
    state = rich_state()
    ck = make_checkpointer()
    result = ck.save(1, state, persist=False)
    assert result.status.value == "in_memory", result
    loaded = ck.load()
    assert loaded.source == "memory" and loaded.step == 1
    assert_same(state, loaded.state)
    restored = loaded.state
    assert shares_storage(restored["view_a"], restored["base"])
    assert shares_storage(restored["view_b"], restored["base"])
    assert not shares_storage(restored["base"], state["base"]), "load must not alias the live tensors"


def test_storage_round_trip_is_bit_exact_and_loads_with_torch_load(make_checkpointer, tmp_path):
    state = rich_state(1)
    ck = make_checkpointer()
    assert ck.save(3, state).wait(60).committed
    loaded = ck.load(prefer_memory=False)
    assert loaded.source == "storage"
    assert_same(state, loaded.state)
    assert shares_storage(loaded.state["view_a"], loaded.state["base"])
    plain = torch.load(tmp_path / "ckpt" / "step-3" / "rank-0.pt", weights_only=False)
    assert_same(state, plain)


def test_restore_in_place_into_live_tensors(make_checkpointer):
    state = {"w": torch.randn(100, 10), "opt": {"m": torch.randn(10)}, "step": 4}
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    saved["opt"] = {"m": state["opt"]["m"].clone()}
    ck = make_checkpointer()
    ck.save(4, state, persist=False)
    live_w, live_m = state["w"], state["opt"]["m"]
    live_w.add_(1.0)
    live_m.zero_()
    result = ck.load(target=state)
    assert result.state["w"] is live_w and result.state["opt"]["m"] is live_m
    assert torch.equal(live_w, saved["w"]) and torch.equal(live_m, saved["opt"]["m"])
    assert result.state["step"] == 4


def test_a_large_restore_copies_on_several_threads_into_the_live_tensors(make_checkpointer):
    """Above PARALLEL_MIN_BYTES the host copies are split over threads: every tensor (a leaf
    that requires grad, a tied weight, an optimizer moment) still comes back bit for bit."""
    from flashckpt_integrations.core.restore import PARALLEL_MIN_BYTES, host_copy_threads

    if host_copy_threads() < 2:
        pytest.skip("one CPU: the copies run on the calling thread")
    torch.manual_seed(3)
    layers = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(24)]  # 96 MiB
    state = {"model": {f"l{i}": p for i, p in enumerate(layers)} | {"tied": layers[5]},
             "opt": {f"m{i}": torch.randn(1 << 18) for i in range(8)}, "step": 9}
    assert sum(p.numel() * 4 for p in layers) > PARALLEL_MIN_BYTES
    expected = {k: v.detach().clone() for k, v in state["model"].items()} | {
        k: v.clone() for k, v in state["opt"].items()}
    ck = make_checkpointer()
    assert ck.save(9, state, persist=False).ok
    with torch.no_grad():
        for p in layers:
            p.zero_()
        for m in state["opt"].values():
            m.fill_(7.0)
    result = ck.load(target=state)
    assert result.source == "memory"
    assert result.state["model"]["l3"] is layers[3] and result.state["model"]["tied"] is layers[5]
    for key, value in expected.items():
        live = state["model"].get(key, state["opt"].get(key))
        assert torch.equal(live, value), key
    assert all(p.requires_grad and p.grad is None for p in layers)


def test_restore_into_mismatched_target_names_the_tensor(make_checkpointer):
    from flashckpt_integrations import LayoutMismatchError

    ck = make_checkpointer()
    ck.save(1, {"w": torch.zeros(3, 4)}, persist=False)
    with pytest.raises(LayoutMismatchError, match=r"w.*\(3, 4\).*\(4, 3\)"):
        ck.load(target={"w": torch.zeros(4, 3)})


class NotAllowed:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, NotAllowed) and other.x == self.x


def test_arbitrary_objects_are_not_unpickled_by_default(make_checkpointer):
    ck = make_checkpointer()
    ck.save(1, {"obj": NotAllowed(3), "t": torch.ones(2)}, persist=False)
    with pytest.raises(Exception, match="weights_only"):
        ck.load()
    assert ck.load(weights_only=False).state["obj"] == NotAllowed(3)
    with torch.serialization.safe_globals([NotAllowed]):
        assert ck.load().state["obj"] == NotAllowed(3)


def test_codecs_write_native_files(make_checkpointer, tmp_path):
    from safetensors.torch import load_file

    weights = {"a": torch.randn(3, 4).t(), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(2).bfloat16()}
    files = {
        "model.safetensors": FileSpec(weights, Codec.SAFETENSORS, metadata={"format": "pt"}),
        "optimizer.pt": {"state": {0: {"exp_avg": torch.randn(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "trainer_state.json": FileSpec({"global_step": 7, "log_history": []}, Codec.JSON),
        "notes.bin": (b"\x00raw bytes\xff", "bytes"),
    }
    ck = make_checkpointer()
    assert ck.save(7, files=files).wait(60).committed
    step_dir = tmp_path / "ckpt" / "step-7"
    read_back = load_file(step_dir / "model.safetensors")
    for name, tensor in weights.items():
        assert torch.equal(read_back[name], tensor), name
    opt = torch.load(step_dir / "optimizer.pt", weights_only=True)
    assert torch.equal(opt["state"][0]["exp_avg"], files["optimizer.pt"]["state"][0]["exp_avg"])
    assert (step_dir / "trainer_state.json").read_text().startswith("{")
    assert (step_dir / "notes.bin").read_bytes() == b"\x00raw bytes\xff"
    for source in ("memory", "storage"):
        loaded = ck.load(prefer_memory=source == "memory")
        assert loaded.source == source
        assert loaded.files["notes.bin"] == b"\x00raw bytes\xff"
        assert loaded.files["trainer_state.json"]["global_step"] == 7
        for name, tensor in weights.items():
            assert torch.equal(loaded.files["model.safetensors"][name], tensor)


def test_safetensors_rejects_shared_tensors_up_front(make_checkpointer):
    base = torch.randn(4, 4)
    ck = make_checkpointer()
    with pytest.raises(ValueError, match="share memory"):
        ck.save(1, files={"m.safetensors": FileSpec({"a": base, "b": base}, Codec.SAFETENSORS)})


def test_bad_input_is_rejected_with_a_clear_error(make_checkpointer):
    ck = make_checkpointer()
    with pytest.raises(ValueError, match="non-negative int"):
        ck.save(-1, {"a": torch.ones(1)})
    with pytest.raises(ValueError, match="exactly one"):
        ck.save(1)
    with pytest.raises(ValueError, match="relative path"):
        ck.save(1, files={"../x.pt": {}})
    with pytest.raises(ValueError, match="safetensors codec takes a flat dict"):
        ck.save(1, files={"m.safetensors": FileSpec({"a": {"nested": torch.ones(1)}}, Codec.SAFETENSORS)})
    with pytest.raises(ValueError, match="bytes codec takes bytes"):
        ck.save(1, files={"raw.bin": FileSpec("text", Codec.BYTES)})


def test_marker_checksums_detect_a_changed_file(make_checkpointer, tmp_path):
    from flashckpt_integrations import CorruptCheckpointError

    ck = make_checkpointer()
    assert ck.save(2, {"w": torch.randn(1000)}).wait(60).committed
    path = tmp_path / "ckpt" / "step-2" / "rank-0.pt"
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF
    path.write_bytes(bytes(data))
    assert zlib.crc32(bytes(data)) != 0
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        ck.load(prefer_memory=False)
    os.unlink(path)


def test_a_rank_with_nothing_to_write_still_takes_part(make_checkpointer):
    ck = make_checkpointer()
    assert ck.save(5, files={}).wait(60).committed
    assert ck.load(prefer_memory=False).files == {} and ck.load().files == {}


def test_torch_codec_pickle_is_byte_identical_to_torch_save(tmp_path):
    import io
    import zipfile

    from flashckpt_integrations.core.state import normalize_files, plan_snapshot

    base = torch.randn(6, 4)
    state = {"w": base, "t": base.t(), "v": base[1:3], "i": torch.arange(5), "b": torch.ones(2, dtype=torch.bool),
             "h": torch.randn(3).bfloat16(), "g": torch.randn(2, requires_grad=True), "f8": torch.zeros(2).to(
                 torch.float8_e5m2), "p": torch.nn.Parameter(torch.randn(2)), "meta": {"lr": 0.1, "n": [1, 2]}}
    (plan,) = plan_snapshot(normalize_files({"x.pt": state})).files
    buf = io.BytesIO()
    torch.save(state, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        assert plan.blob == archive.read(name)


@pytest.mark.parametrize("codec", [Codec.TORCH, Codec.PARTS])
def test_a_slot_written_again_with_another_dtype_or_shape_in_place_holds_the_new_bytes(make_checkpointer, codec):
    """A copy reuses the views of the slot the previous copy into it wrote through (same place,
    dtype and shape): a region at the same place with another dtype or shape gets its own."""
    ck = make_checkpointer(slots=1)
    values = [torch.arange(16, dtype=torch.float32).reshape(4, 4),
              torch.arange(16, dtype=torch.int32).reshape(4, 4) * 7,  # same bytes, another dtype
              torch.arange(16, dtype=torch.int32).reshape(2, 8) - 3,  # same bytes, another shape
              torch.arange(16, dtype=torch.int32).reshape(2, 8) + 100]  # the same view again
    for step, w in enumerate(values, 1):
        obj = [w] if codec is Codec.PARTS else {"w": w}
        assert ck.save(step, files={"f.bin": FileSpec(obj, codec)}, persist=False).ok
        loaded = ck.load(step).files["f.bin"]
        got = loaded[0] if codec is Codec.PARTS else loaded["w"]
        assert got.dtype == w.dtype and torch.equal(got, w), step
