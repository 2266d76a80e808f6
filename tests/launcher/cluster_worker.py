"""The worker of the simulated-cluster tests: one per node, it records its ranks and meets the others.

    cluster_worker.py --out DIR [--raise-on NODE] [--sigbus-on NODE]

Each worker joins a gloo group, meets the others in a barrier and appends what it is (node name,
RANK, GROUP_RANK, WORLD_SIZE, and MASTER_PORT, which names the rendezvous round) to
``DIR/records.jsonl``. Then, in the first round a node takes part in, the failure the test asks
for: ``--raise-on`` makes that node's worker raise a Python exception, ``--sigbus-on`` kills that
node's worker with SIGBUS (a marker file ``DIR/fault-NODE`` keeps it to one round). The others
meet in a second barrier, which fails where a peer died.
"""

import argparse
import datetime
import json
import os
import resource
import signal
import sys

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--raise-on", default=None)
    parser.add_argument("--sigbus-on", default=None)
    args = parser.parse_args()
    node = os.environ["FLASHCKPT_NODE_NAME"]
    marker = os.path.join(args.out, f"fault-{node}")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    record = {"node": node, "rank": int(os.environ["RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
              "world": int(os.environ["WORLD_SIZE"]), "round": os.environ["MASTER_PORT"]}
    with open(os.path.join(args.out, "records.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    if node in (args.raise_on, args.sigbus_on) and not os.path.exists(marker):
        open(marker, "w").close()
        if node == args.raise_on:
            raise RuntimeError(f"injected failure in the training script on {node}")
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signal.SIGBUS)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort at interpreter exit


if __name__ == "__main__":
    main()
