"""The flashckpt command on real checkpoints."""

import contextlib
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from flashckpt_integrations import cli
from flashckpt_integrations._utils.help import HelpFormatter


def flashckpt(*args):
    """Run the command in this process (as its console script does): returncode, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["--shm-dir", os.environ["FLASHCKPT_SHM_DIR"], *args])
        except SystemExit as exc:  # argparse: --help, --version, usage errors
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_ls_inspect_clean(make_checkpointer, tmp_path):
    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt)
    assert ck.save(1, {"w": torch.ones(1000)}).wait(60).committed
    ck.save(2, {"w": torch.ones(1000)}, persist=False)

    listing = json.loads(flashckpt("ls", str(ckpt), "--json").stdout)
    assert listing["committed"] == [1]
    assert sorted((m["rank"], m["step"], m["state"]) for m in listing["memory"]) == [(0, 1, "complete"),
                                                                                      (0, 2, "complete")]
    assert "committed steps: 1" in flashckpt("ls", str(ckpt)).stdout

    shown = json.loads(flashckpt("inspect", str(ckpt), "1", "--json").stdout)
    (entry,) = shown["ranks"][0]["files"]
    assert entry["path"] == "rank-0.pt" and entry["size"] == os.path.getsize(ckpt / "step-1" / "rank-0.pt")
    missing = flashckpt("inspect", str(ckpt), "2")
    assert missing.returncode == 1 and "not committed" in missing.stderr

    assert "removed 2" in flashckpt("clean", str(ckpt)).stdout
    assert not any(os.path.exists(p) for p in ck.slot_paths)


def test_verify_names_a_flipped_snapshot_and_a_flipped_committed_file(make_checkpointer, tmp_path):
    from tests.helpers import flip_file_byte, flip_slot_byte, rank_slots

    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt)
    assert ck.save(1, {"w": torch.ones(1000)}).wait(60).committed
    ck.save(2, {"w": torch.ones(1000)}, persist=False)
    assert ck.check_memory(2)  # (its checksums are written)
    good = flashckpt("verify", str(ckpt))
    assert good.returncode == 0 and "3 good, 0 not: every copy verifies" in good.stdout, good

    flip_slot_byte(rank_slots(ckpt, 0)[2])
    flip_file_byte(ckpt / "step-1" / "rank-0.pt")
    bad = flashckpt("verify", str(ckpt), "--json")
    assert bad.returncode == 1
    status = {(r["what"], r["step"]): r["status"] for r in json.loads(bad.stdout)["checked"]}
    assert status == {("memory", 1): "ok", ("memory", 2): "bad", ("storage", 1): "bad"}, status
    (ckpt / "step-1" / "rank-0.pt").unlink()  # (the suite checks every torch file a test leaves)


def test_clean_and_ls_find_the_memory_of_a_job_named_by_the_environment(tmp_path):
    """A job named by ``$FLASHCKPT_JOB_ID`` (not by its directory), which exited without close:
    ``flashckpt`` run with the same environment (the job id and the shm-dir knob, no flags)
    finds its slots and removes them."""
    import glob
    import time
    import uuid
    from unittest import mock

    from flashckpt_integrations.core.client import job_key, saver_running
    from flashckpt_integrations.core.protocol import LOG_NAME
    from tests.helpers import kill_savers, run_python

    ckpt = str(tmp_path / "ckpt")
    job_id = f"env-named-{uuid.uuid4().hex[:8]}"
    env = {"FLASHCKPT_JOB_ID": job_id}
    child = (
        "import os, sys, torch\n"
        "from flashckpt_integrations import Checkpointer\n"
        "ck = Checkpointer(sys.argv[1])\n"
        "assert ck.save(1, {'w': torch.ones(1000)}, persist=False).status.value == 'in_memory'\n"
        "ck.client.connect()\n"  # the saver is up (it starts off the training path) before the job dies
        "print(ck.run_dir, flush=True)\n"
        "os._exit(0)\n"  # no close, no atexit: the memory stays
    )
    done = run_python(child, ckpt, env=env)
    assert done.returncode == 0, done.stderr
    run_dir = done.stdout.strip()
    pattern = os.path.join(os.environ["FLASHCKPT_SHM_DIR"], f"flashckpt-{os.getuid()}-{job_key(job_id)}-r0-*")
    try:
        slots = glob.glob(pattern)
        assert slots, "the job's slots are named by its job id, in the knob's shm dir"
        cli_env = {**os.environ, **env}
        run = [sys.executable, "-m", "flashckpt_integrations.cli"]
        listing = subprocess.run([*run, "ls", ckpt, "--json"], env=cli_env, capture_output=True, text=True,
                                 timeout=120)
        memory = json.loads(listing.stdout)["memory"]
        assert (0, 1) in [(m["rank"], m["step"]) for m in memory] and len(memory) == len(slots), listing.stderr
        assert json.loads(listing.stdout)["savers"] == [
            {"run_dir": run_dir, "log": os.path.join(run_dir, LOG_NAME), "running": True}]
        kill_savers(run_dir)
        deadline = time.monotonic() + 10
        while saver_running(run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        with mock.patch.dict(os.environ, env):
            shown = flashckpt("ls", ckpt)
        assert "saver:           not running" in shown.stdout and os.path.join(run_dir, LOG_NAME) in shown.stdout
        cleaned = subprocess.run([*run, "clean", ckpt], env=cli_env, capture_output=True, text=True, timeout=120)
        assert cleaned.returncode == 0 and f"removed {len(slots)} shared-memory slot(s)" in cleaned.stdout, (
            cleaned.stdout + cleaned.stderr)
        assert glob.glob(pattern) == []
    finally:
        kill_savers(run_dir)
        for path in glob.glob(pattern):
            os.unlink(path)


def _parsers(parser):
    """``parser`` and every sub-command's parser."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, cli.argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_parsers(sub))
    return found


REST_MARKUP = ("``", ":func:", ":class:", ":meth:", ":mod:", ":attr:", "`_", ".. ")


def test_help_is_plain_text_every_argument_has_help_and_options_show_their_defaults():
    for parser in _parsers(cli.build_parser()):
        text = parser.format_help()
        assert not [m for m in REST_MARKUP if m in text], f"reST markup in the help of {parser.prog}:\n{text}"
        assert "exit status:" in text, f"{parser.prog} --help says what the exit codes mean"
        for action in parser._actions:
            if isinstance(action, cli.argparse._SubParsersAction):
                assert all(choice.help for choice in action._choices_actions)
                continue
            assert action.help and action.help != cli.argparse.SUPPRESS, f"{parser.prog}: {action.dest} has no help"
            if action.option_strings and action.nargs != 0:  # options that take a value say their default
                assert "(default" in parser._get_formatter()._expand_help(action), (parser.prog, action.dest)


def test_help_formatter_shows_a_set_default():
    parser = cli.argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--timeout", type=float, default=12.5, help="seconds to wait")
    parser.add_argument("--name", default=None, help="a name (default: the host's)")
    text = " ".join(parser.format_help().split())
    assert "seconds to wait (default: 12.5)" in text and "(default: the host's)" in text
    assert "default: None" not in text


def test_plain_text_drops_rest_markup():
    from flashckpt_integrations._utils.help import plain_text

    assert plain_text("use ``--rdzv-backend=static`` or :func:`torch.load`, `x`") == (
        "use --rdzv-backend=static or torch.load, x")
    assert plain_text(None) is None


def test_job_id_and_shm_dir_go_before_or_after_the_command():
    parse = cli.build_parser().parse_args
    for command in (["ls", "d"], ["inspect", "d", "3"], ["clean", "d"], ["persist", "d"]):
        assert (parse(command).job_id, parse(command).shm_dir) == (None, None)
        before = parse(["--job-id", "A", "--shm-dir", "/a", *command])
        after = parse([*command, "--job-id", "B", "--shm-dir", "/b"])
        both = parse(["--job-id", "A", "--shm-dir", "/a", *command, "--job-id", "B"])
        assert (before.job_id, before.shm_dir) == ("A", "/a")
        assert (after.job_id, after.shm_dir) == ("B", "/b")
        assert (both.job_id, both.shm_dir) == ("B", "/a"), "after the command wins; what is not repeated stays"


def test_ls_finds_a_named_job_with_the_options_after_the_command(make_checkpointer, tmp_path, monkeypatch):
    import uuid

    from flashckpt_integrations import CheckpointerConfig

    job_id = f"cli-after-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt, config=CheckpointerConfig(job_id=job_id))
    assert ck.save(3, {"w": torch.ones(10)}, persist=False).status.value == "in_memory"
    assert ck.wait_for_snapshot() is None  # a first save is sealed once the attempt's record is written
    shm_dir = os.environ["FLASHCKPT_SHM_DIR"]
    monkeypatch.delenv("FLASHCKPT_SHM_DIR")  # only the option says where the slots are
    monkeypatch.delenv("FLASHCKPT_JOB_ID", raising=False)

    def steps(*args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(list(args)) == 0
        return [m["step"] for m in json.loads(out.getvalue())["memory"] if m["state"] == "complete"]

    assert steps("ls", str(ckpt), "--json", "--shm-dir", shm_dir) == [], "named by DIR: another job"
    assert steps("ls", str(ckpt), "--job-id", job_id, "--json", "--shm-dir", shm_dir) == [3]
    assert steps("--job-id", job_id, "--shm-dir", shm_dir, "ls", str(ckpt), "--json") == [3]
    assert steps("--shm-dir", "/nonexistent", "ls", str(ckpt), "--job-id", job_id, "--shm-dir", shm_dir,
                 "--json") == [3]


def test_version():
    from importlib.metadata import version

    import flashckpt_integrations

    shown = flashckpt("--version")
    assert shown.returncode == 0 and shown.stdout.strip() == f"flashckpt {version('flashckpt-integrations')}"
    assert cli.package_version("no-such-distribution-here") == flashckpt_integrations.__version__


def test_ls_and_inspect_of_a_missing_directory_fail(tmp_path):
    missing = tmp_path / "missing"
    for command in (["ls", str(missing)], ["ls", str(missing), "--json"], ["inspect", str(missing), "1"]):
        done = flashckpt(*command)
        assert done.returncode == 2, command
        assert done.stderr.strip() == f"flashckpt: {missing} does not exist" and done.stdout == ""
    (tmp_path / "file").write_text("x")
    done = flashckpt("ls", str(tmp_path / "file"))
    assert done.returncode == 2 and "is not a directory" in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = flashckpt("ls", str(empty))
    assert done.returncode == 0 and "committed steps: -" in done.stdout, "an existing, empty directory is fine"


def test_ls_of_a_missing_directory_points_at_the_memory_left_behind(make_checkpointer, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt)
    for step in (1, 2):  # both slots hold a snapshot (the second is not only made in the background)
        ck.save(step, {"w": torch.ones(10)}, persist=False)
    shutil.rmtree(ckpt)
    done = flashckpt("ls", str(ckpt))
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert "2 shared-memory slot(s)" in done.stderr and f"flashckpt clean {ckpt}" in done.stderr


def test_an_unknown_storage_scheme_is_one_clear_line(tmp_path):
    run = [sys.executable, "-m", "flashckpt_integrations.cli"]
    for command in (["ls", "myscheme://bucket/x"], ["inspect", "myscheme://bucket/x", "1"]):
        done = subprocess.run([*run, *command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        line = done.stderr.strip()
        assert "myscheme://bucket/x" in line and "'flashckpt_integrations.storage' entry-point group" in line
        assert "fsspec" in line and "install" in line


def test_sizes_have_units():
    assert [cli._format_size(n) for n in (0, 1000, 1536, 5 * 2**20, 3 * 2**30, 2**50)] == [
        "0 B", "1000 B", "1.5 KiB", "5.0 MiB", "3.0 GiB", "1024.0 TiB"]


def test_progress_bar_draws_each_shown_value_once_and_100_percent_once():
    stream = io.StringIO()
    bar = cli._ProgressBar(stream)
    bar.INTERVAL = 0.0  # every change is drawn here, however fast the calls come
    for done in range(10 * 2**20, 10 * 2**20 + 5000, 10):  # 500 calls that all show 10.0 MiB of 1.0 GiB
        bar(done, 2**30)
    for done in range(2**30, 2**30 + 4000, 100):  # the written bytes overshoot the estimate (zip overhead)
        bar(done, 2**30)
    bar.finish()
    lines = stream.getvalue().split("\r")[1:]
    assert len(lines) == 2, lines
    assert "  1%  10.0 MiB/1.0 GiB" in lines[0]
    assert lines[1].count("100%") == 1 and lines[1].endswith("\n")
    assert lines[1].rstrip().endswith("100%  1.0 GiB/1.0 GiB"), "the final line shows what was written"


def test_progress_bar_of_a_small_file_and_of_a_failed_persist():
    stream = io.StringIO()
    bar = cli._ProgressBar(stream)
    bar.INTERVAL = 0.0
    bar(1000, 3000)
    bar(1000, 3000)
    bar(2048, 3000)
    bar.finish(complete=False)
    out = stream.getvalue()
    assert out.count("\r") == 2 and "1000 B/2.9 KiB" in out and "2.0 KiB/2.9 KiB" in out and "MiB" not in out
    assert "100%" not in out and out.endswith("\n"), "a failed persist does not end at 100%"
    quiet = io.StringIO()
    cli._ProgressBar(quiet).finish()
    assert quiet.getvalue() == "", "nothing written, nothing drawn"


def test_ls_shows_the_saver_run_directory_its_log_and_whether_it_runs(make_checkpointer, tmp_path):
    from flashckpt_integrations.core.protocol import LOG_NAME

    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt)
    assert ck.save(1, {"w": torch.ones(10)}).wait(60).committed  # the saver runs once a persist was asked
    (saver,) = json.loads(flashckpt("ls", str(ckpt), "--json").stdout)["savers"]
    assert saver == {"run_dir": ck.run_dir, "log": os.path.join(ck.run_dir, LOG_NAME), "running": True}
    text = flashckpt("ls", str(ckpt)).stdout
    assert "saver:           running" in text and f"run dir:       {ck.run_dir}" in text
    assert f"log:           {os.path.join(ck.run_dir, LOG_NAME)}" in text
    other = tmp_path / "other"
    other.mkdir()
    assert "saver:           none on this host" in flashckpt("ls", str(other)).stdout


def test_persist_draws_100_percent_once_in_units_that_fit(make_checkpointer, tmp_path):
    from flashckpt_integrations.core.layout import committed_steps
    from flashckpt_integrations.core.storage import LocalStorage

    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt)
    assert ck.save(1, {"w": torch.ones(1000), "b": torch.ones(3)}, persist=False).status.value == "in_memory"
    assert ck.wait_for_snapshot() is None  # a first save is sealed once the attempt's record is written
    done = flashckpt("persist", str(ckpt))
    assert done.returncode == 0 and done.stdout.startswith("committed: "), done.stdout + done.stderr
    assert committed_steps(LocalStorage(str(ckpt))) == [1]
    bar = done.stderr.split("\n")[0]
    assert bar.count("100%") == 1 and bar.rstrip().endswith("KiB"), bar
    assert "0.0 MiB" not in done.stderr + done.stdout and " KiB written" in done.stdout, done.stdout
