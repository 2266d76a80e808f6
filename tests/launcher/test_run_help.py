"""``flashckpt-run --help`` and what it says about restarts."""

import os
import subprocess
import sys

from flashckpt_integrations.launcher import run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN = ["--checkpoint-dir", "--job-id", "--auto-config", "--node-check", "--node-check-timeout",
       "--node-check-report", "--commit-timeout", "--drain-timeout", "--no-warm-start", "--warm-start-preload",
       "--node-name", "--topology-switch",
       "--topology-file", "--topology-key", "--node-failure-handler", "--node-failure-threshold"]


def test_help_lists_the_launchers_own_options_first_with_their_defaults_in_plain_text():
    parser = run.build_parser()
    text = parser.format_help()
    usage = text.split("\n\n")[0]
    assert len(usage.splitlines()) <= 2 and "training_script" in usage, usage
    own_at, torchrun_at = text.index(f"{run.OWN_GROUP}:\n"), text.index(f"{run.TORCHRUN_GROUP}:\n")
    assert own_at < torchrun_at < text.index("--nnodes NNODES")
    own_section = text[own_at:torchrun_at]
    assert [flag for flag in OWN if f"  {flag}" in own_section] == OWN
    assert sorted(run._OWN_OPTIONS) == sorted(OWN), "every option of the launcher is in its section"
    for flag, default in (("--node-check-timeout", "300.0"), ("--commit-timeout", "120.0"),
                          ("--drain-timeout", "300.0")):
        entry = " ".join(own_section[own_section.index(f"  {flag}"):].split("\n  --")[0].split())
        assert f"(default: {default})" in entry, entry
    for action in parser._actions:
        assert action.help, f"{action.dest} has no help"
    assert "``" not in text and ":func:" not in text and "`" not in text, "reST markup in the help"


def test_the_node_check_report_path_reaches_the_check_and_not_torchrun():
    argv = ["--node-check", "--node-check-report", "/tmp/report.json", "--nproc-per-node", "2", "train.py", "--lr", "1"]
    args = run.parse_args(argv)
    assert args.node_check and args.node_check_report == "/tmp/report.json"
    assert run.torchrun_argv(argv, args) == ["--nproc-per-node", "2", "train.py", "--lr", "1"]


def test_the_restart_notice_says_restarts_are_off_with_max_restarts_0():
    assert run._restart_notice(0) == ("no --checkpoint-dir: restarts are off (--max-restarts 0), and nothing is "
                                     "persisted from memory on failure or stop")
    assert "restarted (up to 3 times)" in run._restart_notice(3)
    assert run._after_failure(0, 0).startswith("restarts are off")
    assert run._after_failure(2, 2) == "restarting the workers (restart 1 of 2)"
    assert run._after_failure(0, 2) == "no restarts left (--max-restarts 2)"


def test_a_failed_worker_with_max_restarts_0_is_not_said_to_be_restarted(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)\n")
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env.pop("FLASHCKPT_JOB_ID", None)
    done = subprocess.run([sys.executable, "-m", "flashckpt_integrations.launcher.run", "--standalone",
                           "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.05",
                           str(script)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "restarts are off (--max-restarts 0)" in output and "restarted" not in output, output[-3000:]
    assert "restarts are off (--max-restarts 0): not restarting the workers" in output, output[-3000:]
