"""The accelerator path on a CUDA GPU (issue 19's acceptance list). Skips without one.

Each test is built so that it fails when the property it names does not hold: a long kernel
(``torch.cuda._sleep``) is queued before the state changes, so a copy that is not ordered after
it, or a step that does not wait for the copy, reads or writes the wrong values.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time

import pytest
import torch

from flashckpt_integrations.core.state import Codec, FileSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cycles_per_second() -> int:
    """How many ``torch.cuda._sleep`` cycles take about one second on this GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    return int(10_000_000 / max(time.perf_counter() - start, 1e-6))


def test_device_tensors_round_trip_and_come_back_on_their_device(make_checkpointer):
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda").half(),
             "cpu": torch.ones(3)}
    ck = make_checkpointer()
    ck.prepare(state)  # registers both slots here, ahead of the first save
    assert all(slot.pinned for slot in map(ck.slots.mapped, range(ck.slots.count)))
    assert ck.save(1, state).wait(120).committed
    for prefer_memory in (True, False):
        loaded = ck.load(prefer_memory=prefer_memory).state
        assert loaded["w"].is_cuda and torch.equal(loaded["w"], state["w"])
        assert torch.equal(loaded["b"], state["b"]) and torch.equal(loaded["cpu"], state["cpu"])


def _race(make_checkpointer, tmp_path, *, attach: bool) -> bool:
    """Queue ~0.5 s of GPU work, change the weight in place behind it, save overlapped, step.

    Returns whether the snapshot holds the values from before the optimizer step.
    """
    model = torch.nn.Linear(4096, 4096).cuda()
    pad = torch.randn(256 << 20, device="cuda")  # 1 GiB copied first: the weight's copy comes after the step
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ck = make_checkpointer(tmp_path / f"race-{attach}", optimizers=[opt] if attach else [], async_snapshot=True)
    cycles = _cycles_per_second()
    torch.cuda._sleep(cycles // 2)
    with torch.no_grad():
        model.weight.mul_(2.0)  # queued behind the sleep: the snapshot must see it
    reference = model.weight.detach().clone()  # queued on the same stream: equals the pre-step weight
    ck.save(1, {"pad": pad, "model": model.state_dict()}, persist=False)
    model(torch.randn(64, 4096, device="cuda")).sum().backward()
    opt.step()  # with the hook: its stream waits for the copy's done event
    ck.wait_for_snapshot()
    expected = reference.cpu()
    loaded = ck.load(1, map_location="cpu").state
    return torch.equal(loaded["model"]["weight"], expected)


def test_overlapped_snapshot_holds_the_values_before_the_step_with_the_hook(make_checkpointer, tmp_path):
    assert _race(make_checkpointer, tmp_path, attach=True)


def test_without_the_hook_the_step_races_the_copy(make_checkpointer, tmp_path):
    """The control: nothing orders the step after the copy, so the snapshot sees post-step values
    (shows that the test above can fail). The copy is large enough to be in flight at the step."""
    raced = [not _race(make_checkpointer, tmp_path / str(i), attach=False) for i in range(3)]
    assert any(raced), "the step never raced the copy: the hook test above proves nothing on this GPU"


def test_the_copy_runs_on_a_side_stream(make_checkpointer):
    """1 s of work queued right after save() finishes in about 1 s, not 1 s plus the copy."""
    state = {f"t{i}": torch.randn(16 << 20, device="cuda") for i in range(64)}  # 4 GiB
    ck = make_checkpointer(async_snapshot=True)
    ck.prepare(state)
    ck.save(0, state, persist=False)
    ck.wait_for_snapshot()
    torch.cuda.synchronize()
    start = time.perf_counter()
    copy = ck.save(1, state, persist=False)
    ck.wait_for_snapshot()
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - start
    cycles = _cycles_per_second()
    torch.cuda.synchronize()
    start = time.perf_counter()
    ck.save(2, state, persist=False)
    torch.cuda._sleep(cycles)  # on the default stream, queued after save() returned
    torch.cuda.current_stream().synchronize()
    work_s = time.perf_counter() - start
    ck.wait_for_snapshot()
    assert copy.ok
    assert work_s < 1.0 + 0.25 * copy_s + 0.05, (work_s, copy_s)


def _dtype_cases() -> dict[str, torch.Tensor]:
    base = torch.randn(64, 48, device="cuda")
    cases = {
        "f32": base, "bf16": base.bfloat16(), "f16": base.half(), "i64": torch.arange(100, device="cuda"),
        "bool": base > 0, "zero": torch.empty(0, 5, device="cuda"),
        "noncontig": torch.randn(48, 64, device="cuda").t(), "slice": torch.randn(12, 10, device="cuda")[3:9, ::2],
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            cases[name] = base.to(getattr(torch, name))
    return cases


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (fp8 has no ``torch.equal``)."""
    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(
        got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("codec", [Codec.TORCH, Codec.SAFETENSORS])
def test_many_dtypes_and_layouts_round_trip_through_both_codecs(make_checkpointer, codec):
    cases = _dtype_cases()
    if codec is Codec.TORCH:
        shared = torch.randn(100, device="cuda")
        obj = {**cases, "a": shared[:50], "b": shared[25:], "whole": shared}  # shared storages
    else:
        obj = cases
    ck = make_checkpointer()
    assert ck.save(1, files={"f": FileSpec(obj, codec)}).wait(120).committed
    for prefer_memory in (True, False):
        loaded = ck.load(prefer_memory=prefer_memory, map_location="cuda").files["f"]
        for name, tensor in obj.items():
            assert _same_bytes(loaded[name], tensor), name
        if codec is Codec.TORCH:  # shared storages come back shared
            assert loaded["a"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()


def test_restore_into_cuda_targets_needs_no_second_copy_on_the_device(make_checkpointer):
    state = {f"t{i}": torch.randn(8 << 20, device="cuda") for i in range(16)}  # 512 MiB
    nbytes = sum(t.nbytes for t in state.values())
    expected = {k: v.clone() for k, v in state.items()}
    ck = make_checkpointer()
    assert ck.save(1, state, persist=False).ok
    for t in state.values():
        t.zero_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded = ck.load(target=state)
    extra = torch.cuda.max_memory_allocated() - before
    assert loaded.source == "memory"
    assert all(loaded.state[k] is state[k] for k in state)  # restored in place
    assert all(torch.equal(state[k], expected[k]) for k in state)
    assert extra < 0.05 * nbytes, f"restore allocated {extra / 2**20:.0f} MiB on the GPU for {nbytes / 2**20:.0f} MiB"


def test_restore_after_a_restart_pins_the_reattached_slot(make_checkpointer, tmp_path):
    state = {"w": torch.randn(4 << 20, device="cuda")}
    ck = make_checkpointer(tmp_path / "ckpt", job_id="gpu-reattach")
    assert ck.save(1, state, persist=False).ok
    ck.shutdown(clean=False)  # as a crash would: the slots stay
    again = make_checkpointer(tmp_path / "ckpt", job_id="gpu-reattach")
    assert again.load(target=state).source == "memory"
    assert any(slot is not None and slot.pinned for slot in map(again.slots.mapped, range(again.slots.count)))


def test_the_saver_process_never_maps_libcuda(make_checkpointer):
    state = {"w": torch.randn(1 << 20, device="cuda")}
    ck = make_checkpointer()
    assert ck.save(1, state).wait(120).committed
    pids = subprocess.run(["pgrep", "-f", f"flashckpt_integrations.core.saver --run-dir {ck.run_dir}"],
                          capture_output=True, text=True).stdout.split()
    assert pids, "no saver process found"
    for pid in pids:
        maps = open(f"/proc/{pid}/maps").read()
        assert "libcuda" not in maps, f"saver {pid} mapped libcuda"


def test_pinning_from_the_background_makes_no_context_on_another_gpu(tmp_path):
    """Saves on GPU 1 register their slots for GPU 1: no CUDA context appears on GPU 0."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    code = textwrap.dedent(f"""
        import torch, subprocess, os
        from flashckpt_integrations import Checkpointer
        torch.cuda.set_device(1)
        ck = Checkpointer({str(tmp_path / 'ckpt')!r}, job_id="gpu-ctx")
        state = {{"w": torch.randn(1 << 22, device="cuda:1")}}
        for step in range(3):
            assert ck.save(step, state, persist=False).ok
        ck.slots.helper.submit(lambda: None).result()
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout
        gpu0 = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=uuid", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
        mine = [line for line in out.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
        assert not [line for line in mine if gpu0 in line], mine
        ck.close()
        print("OK")
    """)
    proc = subprocess.run(["python", "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.plants_pin_failure
def test_a_failed_registration_is_cleared_and_not_retried(monkeypatch, make_checkpointer, caplog):
    from flashckpt_integrations._utils import devices

    calls = []
    real = torch.cuda.cudart()

    class FailingCudart:
        def __getattr__(self, name):
            return getattr(real, name)

        def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - CUDA's name
            calls.append(flags)
            return 1  # cudaErrorInvalidValue

    monkeypatch.setattr(devices, "_PIN_FAILED", [])
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FailingCudart())
    state = {"w": torch.randn(1 << 20, device="cuda")}
    ck = make_checkpointer()
    ck.prepare(state)
    for step in range(3):
        assert ck.save(step, state, persist=False).ok
    monkeypatch.setattr(torch.cuda, "cudart", lambda: real)
    assert calls == [devices.CUDA_HOST_REGISTER_PORTABLE], calls  # tried once, with torch's flag
    assert len([r for r in caplog.records if "page-locking" in r.getMessage()]) == 1
    torch.ones(4, device="cuda").add_(1)  # the thread's next launch does not see a stale error
    torch.cuda.synchronize()


def test_restore_from_storage_into_cuda_targets(make_checkpointer):
    """The one-pass storage reader with device targets: over an older commit (read in place
    where it can) and with only one commit (read, verified, then copied)."""
    state = {f"t{i}": torch.randn(1 << 20, device="cuda") for i in range(4)}
    state["half"] = torch.randn(333, device="cuda").half()
    ck = make_checkpointer()
    assert ck.save(1, state).wait(120).committed
    first = {k: v.clone() for k, v in state.items()}
    for t in state.values():
        t.add_(1)
    second = {k: v.clone() for k, v in state.items()}
    assert ck.save(2, state).wait(120).committed
    for step, expected in ((2, second), (1, first)):
        for t in state.values():
            t.zero_()
        loaded = ck.load(step, target=state, prefer_memory=False)
        assert loaded.source != "memory" and loaded.step == step
        for k, v in expected.items():
            assert loaded.state[k].is_cuda and torch.equal(loaded.state[k], v), (step, k)


def test_a_state_over_a_gib_saves_and_restores_through_its_page_locked_slot(make_checkpointer):
    """Tensors lie across the slot's first GiB: the slot is registered as one range, since CUDA
    refuses a copy whose host range spans two registrations."""
    state = {"head": torch.randn(1 << 10, device="cuda"), "big": torch.randn(300 << 20, device="cuda"),
             "tail": torch.randn(1 << 20, device="cuda")}
    expected = {k: v.clone() for k, v in state.items()}
    ck = make_checkpointer()
    ck.prepare(state)
    assert all(slot.pinned for slot in map(ck.slots.mapped, range(ck.slots.count)))
    for step in (1, 2):  # into each slot
        result = ck.save(step, state, persist=False)
        assert result.ok, result.reason
    for t in state.values():
        t.zero_()
    assert ck.load(target=state).source == "memory"
    assert all(torch.equal(state[k], expected[k]) for k in state)
