"""The accelerator path, on a machine with a CUDA GPU (exits with a message elsewhere).

Measures, side by side in one run (medians over --repeats):
  pinned_copy      device-to-host copy of the state into a plain pinned host buffer (the limit)
  warm_save        blocking time of a synchronous Checkpointer.save into a page-locked slot
  restore_fresh    Checkpointer.load(target=state) from memory into the device tensors right after
                   the save (it waits for the save's background checksum, then verifies)
  restore          the same for a snapshot whose checksums are written (as after a restart)
  step_alone       a real forward/backward/optimizer step of a GPT-like MLP stack
  step_with_save   the same step right after save(async_snapshot=True): the stall it adds
  save_call        how long that save(async_snapshot=True) call itself blocked

and, once: the time to page-lock both slots (prepare), whether they ended up page-locked, the
extra GPU memory a restore into the live tensors takes, and the targets: D2H into the
slot >= 0.8x the plain pinned buffer, overlapped stall <= 0.1x the synchronous copy.

    python benchmarks/bench_cuda.py --gib 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid

import torch

from flashckpt_integrations import Checkpointer, CheckpointerConfig


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32768,
                        help="tokens per training step (the step's length against the copy's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    per = int(args.gib * 2**30 / 4 / args.tensors)
    state = {f"t{i}": torch.randn(per, device="cuda") for i in range(args.tensors)}
    nbytes = sum(t.nbytes for t in state.values())
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned_copy() -> None:
        offset = 0
        for t in state.values():
            host[offset : offset + t.nbytes].view(torch.float32).copy_(t, non_blocking=True)
            offset += t.nbytes

    width = 8192
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).cuda().bfloat16()
    opt = torch.optim.AdamW(model.parameters())
    batch = torch.randn(args.tokens, width, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        model(batch).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    def saved(result) -> None:
        if not result.ok:
            raise SystemExit(f"save of step {result.step} failed: {result.reason}")

    rows: dict[str, list[float]] = {k: [] for k in ("pinned_copy", "warm_save", "restore_fresh", "restore",
                                                     "step_alone", "step_with_save", "save_call")}
    with tempfile.TemporaryDirectory() as root:
        ck = Checkpointer(root, CheckpointerConfig(job_id=f"bench-cuda-{uuid.uuid4().hex}"), optimizers=[opt])
        started = time.perf_counter()
        ck.prepare(state)  # creates, pre-faults and page-locks both slots
        prepare_s = time.perf_counter() - started
        pinned = [bool(slot is not None and slot.pinned) for slot in map(ck.slots.mapped, range(ck.slots.count))]
        for step_no in range(2):
            saved(ck.save(step_no, state, persist=False))
            step()
        extra_gpu = 0
        for rep in range(args.repeats):
            rows["pinned_copy"].append(timed(pinned_copy))
            rows["warm_save"].append(timed(lambda r=rep: saved(ck.save(10 + r, state, persist=False))))
            # right after the save: the load waits for the save's background checksum, then verifies
            rows["restore_fresh"].append(timed(lambda: ck.load(target=state)))
            saved(ck.save(50 + rep, state, persist=False))
            ck.sums.wait()  # as after a restart: the snapshot's checksums are in its slot
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            loaded: list = []
            rows["restore"].append(timed(lambda out=loaded: out.append(ck.load(target=state))))
            if loaded[0].source != "memory":
                raise SystemExit("the restore did not come from memory")
            extra_gpu = max(extra_gpu, torch.cuda.max_memory_allocated() - before)
            rows["step_alone"].append(timed(step))
            overlapped: list = []
            rows["step_with_save"].append(timed(lambda r=rep, out=overlapped: (out.append(
                ck.save(100 + r, state, persist=False, async_snapshot=True)), step())))
            failed = ck.wait_for_snapshot()
            if failed is not None:
                raise SystemExit(f"an overlapped save failed: {failed}")
            rows["save_call"].append(overlapped[0].blocking_s)
        ck.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{nbytes / 2**30:.2f} GiB in {args.tensors} tensors on {torch.cuda.get_device_name()}")
    print(f"{'metric':<16}{'median s':>10}{'GB/s':>8}{'x pinned':>10}")
    for name, value in med.items():
        copies = ("pinned_copy", "warm_save", "restore_fresh", "restore")
        rate = f"{nbytes / value / 1e9:8.1f}" if name in copies else " " * 8
        print(f"{name:<16}{value:10.4f}{rate}{value / med['pinned_copy']:10.2f}")
    stall = max(0.0, med["step_with_save"] - med["step_alone"])
    d2h_ratio = med["pinned_copy"] / med["warm_save"]
    stall_ratio = stall / med["warm_save"]
    print(f"prepare (create + pre-fault + page-lock two slots of {nbytes / 2**30:.2f} GiB): {prepare_s:.3f} s, "
          f"page-locked: {pinned}")
    print(f"D2H into the slot: {nbytes / med['warm_save'] / 1e9:.1f} GB/s vs plain pinned buffer "
          f"{nbytes / med['pinned_copy'] / 1e9:.1f} GB/s = {d2h_ratio:.2f}x (target >= 0.8x): "
          f"{'ok' if d2h_ratio >= 0.8 else 'MISSED'}")
    print(f"overlapped stall per step: {stall:.4f} s vs synchronous copy {med['warm_save']:.4f} s = "
          f"{stall_ratio:.3f}x (target <= 0.1x): {'ok' if stall_ratio <= 0.1 else 'MISSED'}")
    print(f"restore H2D into the live tensors: {nbytes / med['restore'] / 1e9:.1f} GB/s, extra GPU memory "
          f"{extra_gpu / 2**20:.0f} MiB ({extra_gpu / nbytes:.3f}x the state)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
