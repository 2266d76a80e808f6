"""Fault-injection campaign: many seeded kills across the save path of a 2-rank CPU job.

    python benchmarks/bench_faults.py                    # 50 cases, seeds 1000..1049
    python benchmarks/bench_faults.py --cases 200 --seed 7
    python benchmarks/bench_faults.py --seeds 1003,1017  # rerun particular cases
    python benchmarks/bench_faults.py --point saver.commit --cases 10

Each case kills a trainer rank or the saver at one fault point (``FLASHCKPT_FAULT``), at a
visit drawn from the seed; the launcher relaunches the job when a rank died, and every
invariant is checked afterwards (see ``tests/faults/harness.py``). Prints one line per case
and a table: cases per point, passed, failed, where relaunches resumed from (memory, storage,
scratch; "no-relaunch" when only the saver died and the trainers restarted it), and the median
time from relaunch to resumed training. Exits 1 when a case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POINTS = ("trainer.copy", "trainer.sealed", "saver.write", "saver.commit", "retention.delete")
# The package is imported in main() only: the job's ranks fork from a server that re-imports this
# script, and each must import the package itself, after its fault knob is set.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1000, help="first seed; case i uses seed + i")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds to run (overrides --cases/--seed)")
    parser.add_argument("--point", choices=POINTS, default=None, help="only this fault point")
    parser.add_argument("--steps", type=int, default=12, help="training steps of the job")
    parser.add_argument("--persist-every", type=int, default=3, help="persist every this many steps")
    parser.add_argument("--json", default=None, help="also write every case's outcome here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory of failed cases")
    parser.add_argument("--keep-all", action="store_true", help="keep the work directory of every case")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, REPO)
    from flashckpt_integrations._utils import faults
    from tests.faults import harness
    from tests.faults.job import JobConfig, reference

    assert set(harness.CAMPAIGN_POINTS) == set(POINTS) <= set(faults.POINTS), "the fault points changed: update POINTS"
    cfg = JobConfig(steps=args.steps, persist_every=args.persist_every)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(range(args.seed, args.seed + args.cases))
    ref = reference(cfg)
    base = tempfile.mkdtemp(prefix="bench-faults-")
    shm = tempfile.mkdtemp(prefix="bench-faults-", dir="/dev/shm")
    os.environ["FLASHCKPT_SHM_DIR"] = shm
    outcomes = []
    started = time.monotonic()
    try:
        for seed in seeds:
            case = harness.draw(seed, cfg, args.point)
            workdir = os.path.join(base, f"seed-{seed}")
            os.makedirs(workdir)
            outcome = harness.run_case(case, cfg, ref, workdir)
            outcomes.append(outcome)
            print(harness.describe(outcome), flush=True)
            if not args.keep_all and (outcome.passed or not args.keep):
                shutil.rmtree(workdir, ignore_errors=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if args.keep or args.keep_all:
            print(f"work directories kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(harness.table(outcomes))
    failed = [o.case.seed for o in outcomes if not o.passed]
    print(f"\n{len(outcomes)} cases in {time.monotonic() - started:.0f}s; failed seeds: {failed or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**vars(o.case), "passed": o.passed, "fired": o.fired, "relaunched": o.relaunched,
                        "source": o.source, "resumed": o.resumed, "recovery_s": o.recovery_s, "load_s": o.load_s,
                        "seconds": o.seconds, "problems": o.problems} for o in outcomes], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
