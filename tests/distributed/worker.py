"""A scripted rank for the multi-process tests: runs a list of actions, records what it saw.

Run under torchrun. ``--actions`` is a comma-separated list of:
``save:<step>:persist|memory``, ``wait``, ``load``, ``vload`` (load into live tensors),
``mark:<name>`` (touch ``<out>/<name>-<rank>``), ``await:<name>`` (wait for ``<out>/<name>``),
``barrier`` (every rank has got this far), ``kill:<rank>`` (that rank SIGKILLs itself), ``close``.
Each rank writes ``<out>/rank-<rank>.json``.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from flashckpt_integrations import Checkpointer


def state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"w": torch.randn(64, 1024, generator=g), "rank": rank, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--actions", required=True)
    parser.add_argument("--commit-timeout", type=float, default=120)
    parser.add_argument("--storage-factory", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = Checkpointer(args.ckpt, commit_timeout_s=args.commit_timeout, storage_factory=args.storage_factory)
    record = {"rank": rank, "run_dir": ck.run_dir, "pid": os.getpid(), "events": []}
    path = os.path.join(args.out, f"rank-{rank}.json")

    def flush() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    flush()
    results = {}
    for action in args.actions.split(","):
        kind, *rest = action.split(":")
        if kind == "save":
            step = int(rest[0])
            results[step] = ck.save(step, state(step, rank), persist=rest[1] == "persist")
            record["events"].append({"save": step, "status": results[step].status.value})
        elif kind == "wait":
            outcome = ck.wait()
            record["events"].append({"wait": outcome and outcome.step, "committed": outcome and outcome.committed,
                                     "error": outcome and outcome.error})
        elif kind == "load":
            loaded = ck.load()
            ok = loaded is not None and all(
                torch.equal(loaded.state[k], v) if isinstance(v, torch.Tensor) else loaded.state[k] == v
                for k, v in state(loaded.step, rank).items()
            )
            record["events"].append({"load": loaded and loaded.step, "source": loaded and loaded.source, "equal": ok})
        elif kind == "vload":  # into live tensors, as training resumes; verified on the way
            live = {"w": torch.zeros(64, 1024), "rank": -1, "step": -1}
            loaded = ck.load(target=live)
            step = loaded and loaded.step
            ok = loaded is not None and torch.equal(live["w"], state(step, rank)["w"]) and \
                loaded.state["step"] == step
            record["events"].append({"vload": step, "source": loaded and loaded.source, "equal": ok,
                                     "tiers": loaded and {str(k): v for k, v in loaded.tiers.items()},
                                     "fallbacks": loaded and len(loaded.fallbacks)})
        elif kind == "mark":
            open(os.path.join(args.out, f"{rest[0]}-{rank}"), "w").close()
        elif kind == "await":
            while not os.path.exists(os.path.join(args.out, rest[0])):
                time.sleep(0.05)
        elif kind == "barrier":
            dist.barrier()
        elif kind == "kill" and int(rest[0]) == rank:
            flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "close":
            ck.close()
            record["events"].append({"closed": True})
        flush()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
