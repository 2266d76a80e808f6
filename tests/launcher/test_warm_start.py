"""flashckpt-run forks workers from a template that imported torch (launcher/warm_start.py).

Real launcher, real torch elastic restarts, 2 gloo ranks: the restarted workers run the script
as ``__main__`` with their own arguments, environment and ranks, find torch already imported,
and a worker that raises is reported with its traceback and restarted; ``--no-warm-start``
starts fresh interpreters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys
    preloaded = "torch" in sys.modules
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(1) * (rank + 1)
    dist.all_reduce(x)
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(sys.argv[1], f"r{rank}-{restart}.json"), "w") as f:
        json.dump({"preloaded": preloaded, "sum": x.item(), "argv": sys.argv[2:], "name": __name__,
                   "rank_env": os.environ["RANK"], "threads": torch.get_num_threads(),
                   "pgid_is_pid": os.getpgid(0) == os.getpid(), "path0": sys.path[0],
                   "cmdline": open("/proc/self/cmdline", "rb").read().decode().rstrip("\\0").split("\\0")}, f)
    dist.destroy_process_group()
    if restart == 0 and rank == 1:
        raise RuntimeError("boom from rank one")
""")


def _launch(tmp_path, *extra):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / ("out" + "".join(extra).replace("-", ""))
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "flashckpt_integrations.launcher.run", *extra, "--nproc-per-node", "2",
         "--max-restarts", "1", "--monitor-interval", "0.1", str(script), str(out), "x", "y"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    runs = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return done, runs, script


@pytest.mark.timeout(300)
def test_workers_and_restarts_are_forked_warm_and_behave_as_fresh_interpreters(tmp_path):
    done, runs, script = _launch(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(runs) == ["r0-0", "r0-1", "r1-0", "r1-1"], (sorted(runs), done.stderr[-3000:])
    for name, run in runs.items():
        assert run["preloaded"], f"{name}: torch was imported again"
        assert run["sum"] == 3.0 and run["argv"] == ["x", "y"] and run["name"] == "__main__"
        assert run["rank_env"] == name[1] and run["threads"] == 1 and run["pgid_is_pid"]
        assert run["path0"] == str(script.parent)
        # what ps shows: the worker's command, not the template's
        assert run["cmdline"][1:] == ["-u", str(script), *run["cmdline"][3:4], "x", "y"], run["cmdline"]
    assert "boom from rank one" in done.stderr, done.stderr[-3000:]  # the failed rank's traceback

    done, runs, _ = _launch(tmp_path, "--no-warm-start")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(runs) == ["r0-0", "r0-1", "r1-0", "r1-1"]
    assert not any(run["preloaded"] for run in runs.values()), "--no-warm-start still forked the workers"
