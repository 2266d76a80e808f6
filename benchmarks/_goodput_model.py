"""Analytic goodput of the benchmark's configurations at 1k-64k GPUs, calibrated by its measurements.

First-order model (Young 1974, Daly 2006), failures a Poisson process of rate G * lambda that
strikes while the job trains:

    goodput = tau / (tau + delta) * max(0, M - W) / (M + D)

- M = 1 / (G * lambda): the job's mean time between failures (of training time; a failure during a
  restart only lengthens it, which the first order leaves out).
- delta: time a checkpoint holds training; tau: compute time between checkpoints, at the Young/Daly
  optimum tau = sqrt(2 * delta * M) (never below one step).
- D: downtime per failure = restart R0 + restore L (kill until training again).
- W: work lost per failure, redone: half the interval between usable checkpoints, (tau + delta) / 2,
  plus the time a checkpoint takes to become usable (a commit to storage) where that is what the
  restart reads.

`bench_goodput.py` feeds the same function with each run's measured failures, downtimes, step time
and commit time, and the W above, and prints its prediction beside the measured goodput.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

# Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4): 419 unexpected
# interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
RATE_PER_GPU_S = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86400 * LLAMA3_GPUS)
STATE_BYTES = 16e9  # per rank
STEP_S = 10.0  # one training step at scale (the shortest snapshot interval)
NODE_LOSS = 0.25  # share of failures that lose the node's memory (assumption; the benchmark's default)
GPUS_PER_NODE = 8
NIC_GBPS_PER_NODE = 50.0  # 400 Gb/s per node for replica copies and peer restores
# Defaults when no --from-json is given: the medians of `bench_goodput.py --quick` on a 2-core host.
DEFAULTS = {"mem_bytes_per_s": 2.0e9, "restart_s": 5.0}


def calibrate(result: dict[str, Any] | None) -> dict[str, float]:
    if not result:
        return dict(DEFAULTS, source="built-in defaults (from a --quick run)")
    flash = [r for r in result["runs"] if r["config"] == "flashckpt"]
    stalls = [r["stall_s"] for r in flash if r["stall_s"]]
    events = [e for r in result["runs"] for e in r["events"]]
    restarts = [e["restart_s"] - e["load_s"] - e["first_step_s"] for e in events]
    if not stalls or not restarts:
        raise SystemExit("--from-json: the file holds no flashckpt saves or no completed restart; run a longer sweep")
    return {"mem_bytes_per_s": result["state_bytes"] / statistics.median(stalls),
            "restart_s": statistics.median(restarts), "source": "the --json given"}


def goodput(mtbf: float, downtime: float, lost: float, slowdown: float) -> float:
    """Useful share of the time: per failure, ``mtbf`` seconds of training at ``slowdown`` times the
    speed without checkpoints, of which ``lost`` are redone, and ``downtime`` seconds without training."""
    return slowdown * max(0.0, mtbf - lost) / (mtbf + downtime)


def configurations(gpus: int, storage_gbps: float, cal: dict[str, float]) -> dict[str, float]:
    mtbf = 1 / (gpus * RATE_PER_GPU_S)
    per_rank_storage = storage_gbps * 1e9 / gpus
    to_storage = STATE_BYTES / per_rank_storage  # write (or read) one rank's state at its share
    mem = STATE_BYTES / cal["mem_bytes_per_s"]  # snapshot into, or restore from, host memory
    peer = STATE_BYTES / (NIC_GBPS_PER_NODE * 1e9 / GPUS_PER_NODE)
    r0 = cal["restart_s"]
    out = {}
    tau = max(STEP_S, math.sqrt(2 * to_storage * mtbf))
    out["torch.save"] = goodput(mtbf, r0 + to_storage, (tau + to_storage) / 2, tau / (tau + to_storage))
    tau_m = max(STEP_S, math.sqrt(2 * mem * mtbf))
    slowdown = tau_m / (tau_m + mem)
    # Every snapshot persisted when a write fits in tau_m; else back-to-back persists (newest commit 1.5 writes old).
    behind = (tau_m + mem) / 2 + to_storage if to_storage <= tau_m else 1.5 * to_storage
    downtime = (1 - NODE_LOSS) * (r0 + mem) + NODE_LOSS * (r0 + to_storage)
    lost = (1 - NODE_LOSS) * (tau_m + mem) / 2 + NODE_LOSS * behind
    out["flashckpt"] = goodput(mtbf, downtime, lost, slowdown)
    # replicas=1: a node loss restores from the peer's memory, the replica one copy behind
    downtime = (1 - NODE_LOSS) * (r0 + mem) + NODE_LOSS * (r0 + peer)
    lost = (1 - NODE_LOSS) * (tau_m + mem) / 2 + NODE_LOSS * ((tau_m + mem) / 2 + peer)
    out["flashckpt+replicas"] = goodput(mtbf, downtime, lost, slowdown)
    out["mtbf_s"], out["storage_s"] = mtbf, to_storage
    return out


def print_model(result: dict[str, Any] | None, storage_gbps: float) -> None:
    cal = calibrate(result)
    print(__doc__.strip())
    print()
    print("Assumptions:")
    print(f"- failure rate per GPU {RATE_PER_GPU_S:.3g}/s: Llama 3 paper, {LLAMA3_INTERRUPTIONS} unexpected "
          f"interruptions in {LLAMA3_DAYS} days on {LLAMA3_GPUS:,} GPUs")
    print(f"- state {STATE_BYTES / 1e9:.0f} GB per rank; aggregate storage bandwidth {storage_gbps:.0f} GB/s, "
          "shared by all ranks (each gets 1/G of it), for writes and reads alike")
    print(f"- calibration from {cal['source']}: memory snapshot/restore {cal['mem_bytes_per_s'] / 1e9:.2f} GB/s per "
          f"rank (the measured stall per byte), restart R0 {cal['restart_s']:.1f} s (kill to first step, less load "
          "and the step itself; rendezvous at scale takes longer: R0 is a lower bound)")
    print(f"- step {STEP_S:.0f} s; {NODE_LOSS:.0%} of failures lose the node's memory; torch.save blocks for the "
          "write, lost work (tau + delta) / 2, restore from storage")
    print("- flashckpt: delta = memory snapshot, lost work tau/2, restore from memory; on a node loss the newest "
          "commit is one write older than the newest snapshot (1.5 writes old once writes outlast tau: "
          "back to back, in the background), restore from storage")
    print(f"- replicas=1: a node loss restores from the peer's memory over {NIC_GBPS_PER_NODE:.0f} GB/s per node "
          f"({GPUS_PER_NODE} ranks), the replica one copy behind; the peer survives")
    print()
    print("| GPUs | job MTBF | 16 GB write at 1/G | torch.save | flashckpt | flashckpt+replicas |")
    print("|---:|---:|---:|---:|---:|---:|")
    for gpus in (1024, 4096, 16384, 65536):
        c = configurations(gpus, storage_gbps, cal)
        print(f"| {gpus:,} | {c['mtbf_s'] / 3600:.1f} h | {c['storage_s']:.0f} s | {c['torch.save']:.3f} | "
              f"{c['flashckpt']:.3f} | {c['flashckpt+replicas']:.3f} |")
