"""The documentation's Python blocks run as written, and its configuration tables match the code.

Every ```` ```python ```` block of ``README.md``, ``benchmarks/README.md`` and ``docs/*.md`` runs as a
script in a fresh interpreter, in a temporary directory of its own, with a timeout. A block that
cannot run in one process on a CPU (it needs torchrun or a framework this environment lacks) is
marked on the line just before its fence::

    <!-- snippet: skip (needs megatron-core 0.19 on Python 3.12) -->

Skips are few and each gives its reason (checked below). The tables of ``CheckpointerConfig``,
``Layout`` and ``RetentionPolicy`` fields and of the environment variables follow a marker line
(``<!-- config-table: CheckpointerConfig -->``, ``<!-- env-table -->``); their names and defaults
are checked against the dataclasses and ``knobs.py``. To print the rows the code expects::

    python tests/unit/test_readme_snippets.py
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import json
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", "benchmarks/README.md", *sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
MAX_SKIPS = 3
SNIPPET_TIMEOUT_S = 240  # DeepSpeed compiles a small C++ op the first time it runs on a host (cached after)

_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\s*\((.+)\)$")
_TABLE_MARK = re.compile(r"^<!--\s*(config-table|env-table)\s*:?\s*(\w*)\s*-->\s*$")


@dataclass
class Snippet:
    path: str
    line: int
    code: str
    skip: str | None

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def _read(path: str) -> list[str]:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read().splitlines()


def _previous_nonblank(lines: list[str], index: int) -> str:
    for line in reversed(lines[:index]):
        if line.strip():
            return line.strip()
    return ""


def snippets(path: str) -> list[Snippet]:
    """The ```python blocks of ``path`` and their skip reasons."""
    lines = _read(path)
    found, index = [], 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if match.group(1) == "python":
            directive = _DIRECTIVE.match(_previous_nonblank(lines, index))
            skip = None
            if directive:
                skip_match = _SKIP.match(directive.group(1))
                skip = skip_match.group(1).strip() if skip_match else f"<malformed: {directive.group(1)!r}>"
            found.append(Snippet(path, index + 1, "\n".join(lines[index + 1:end]) + "\n", skip))
        index = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [s for path in DOCS for s in snippets(path)]


def directives() -> list[tuple[str, int, str, str]]:
    """Every ``<!-- snippet: ... -->`` line: (path, line number, text, the next non-blank line)."""
    out = []
    for path in DOCS:
        lines = _read(path)
        for index, line in enumerate(lines):
            match = _DIRECTIVE.match(line.strip())
            if match:
                following = next((x.strip() for x in lines[index + 1:] if x.strip()), "")
                out.append((path, index + 1, match.group(1), following))
    return out


# --- the snippets run ---------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    """The environment of a fresh shell: nothing of a launcher, a job id or a test's overrides."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "FLASHCKPT_JOB_ID", "FLASHCKPT_NODE_ID", "FLASHCKPT_SHM_DIR", "FLASHCKPT_FAULT",
            "FLASHCKPT_SAVER_KEEP_RUN_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    return env


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _slots_left(directory: str) -> list[str]:
    """Shared-memory slots still held by the jobs that saved under ``directory``."""
    from flashckpt_integrations.core.rescue import job_slots

    left = []
    for root, dirs, _ in os.walk(directory):
        if ".flashckpt" in dirs:
            left += [p for paths in job_slots(root).values() for p in paths]
            dirs.remove(".flashckpt")
    return left


RUNNABLE = [s for s in all_snippets() if s.skip is None]
PARALLEL = 2
"""Snippets run two at a time: much of each is waiting (imports, the saver's start, commits)."""


@dataclass
class Run:
    work: str
    returncode: int | None
    stdout: str
    stderr: str


def _run(snippet: Snippet, work: str) -> Run:
    script = os.path.join(work, "snippet.py")
    with open(script, "w") as f:
        f.write(snippet.code)
    # a free port for a snippet that sets MASTER_PORT only by default (os.environ.setdefault)
    env = {**_clean_env(), "MASTER_PORT": _free_port()}
    try:
        proc = subprocess.run([sys.executable, script], cwd=work, env=env, capture_output=True, text=True,
                              timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return Run(work, None, str(exc.stdout), str(exc.stderr))
    return Run(work, proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory):
    """Every runnable snippet, started at once on a small pool; each test waits for its own."""
    pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="snippet")
    futures = {s.name: pool.submit(_run, s, str(tmp_path_factory.mktemp("snippet"))) for s in RUNNABLE}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.timeout(len(RUNNABLE) * SNIPPET_TIMEOUT_S)
@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.name for s in RUNNABLE])
def test_snippet_runs(snippet: Snippet, snippet_runs) -> None:
    run = snippet_runs[snippet.name].result()
    output = f"--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-6000:]}"
    assert run.returncode is not None, f"{snippet.name} ran past {SNIPPET_TIMEOUT_S}s\n{output}"
    assert run.returncode == 0, f"{snippet.name} exited with {run.returncode}\n{output}"
    left = _slots_left(run.work)
    for path in left:
        os.unlink(path)
    assert not left, f"{snippet.name} left shared memory behind (it should close its checkpointer): {left}"


def test_snippets_are_found() -> None:
    names = [s.name for s in all_snippets()]
    assert len(names) >= 5, names


def test_skips_are_few_and_explained() -> None:
    skipped = [s for s in all_snippets() if s.skip is not None]
    assert len(skipped) <= MAX_SKIPS, (
        f"{len(skipped)} skipped snippets (at most {MAX_SKIPS}): {[(s.name, s.skip) for s in skipped]}; "
        "make them run in one process instead")
    for s in skipped:
        assert not s.skip.startswith("<malformed"), f"{s.name}: write the marker as <!-- snippet: skip (reason) -->"
        assert len(s.skip.split()) >= 3, f"{s.name}: give the reason for skipping it, not {s.skip!r}"
    for path, line, text, following in directives():
        assert _SKIP.match(text), f"{path}:{line}: unknown snippet directive {text!r}"
        assert following == "```python", f"{path}:{line}: a skip marker must come just before a ```python fence"


def test_paths_named_in_the_docs_exist() -> None:
    """Files of this repository that a command or a sentence names (examples/, benchmarks/, ...) exist."""
    pattern = re.compile(r"(?<![\w./-])((?:examples|benchmarks|scripts|tests|docs|flashckpt_integrations)/"
                         r"[\w./-]*\w)")
    missing = []
    for path in DOCS:
        for number, line in enumerate(_read(path), 1):
            for name in pattern.findall(line):
                if not os.path.exists(os.path.join(REPO, name)):
                    missing.append(f"{path}:{number}: {name}")
    assert not missing, "\n".join(missing)


# --- the configuration tables -------------------------------------------------------------------


def _table(path: str, kind: str, name: str) -> list[list[str]]:
    """The body rows of the Markdown table right after ``<!-- kind: name -->`` in ``path``."""
    lines = _read(path)
    for index, line in enumerate(lines):
        match = _TABLE_MARK.match(line.strip())
        if match and match.group(1) == kind and match.group(2) == name:
            rows = []
            for row in lines[index + 1:]:
                if not row.startswith("|"):
                    if rows:
                        break
                    continue
                cells = [c.strip() for c in row.strip().strip("|").split("|")]
                if not set("".join(cells)) <= set("-: "):
                    rows.append(cells)
            return rows[1:]  # without the header
    raise AssertionError(f"{path} has no table marked <!-- {kind}: {name} -->")


def _code(cell: str) -> str:
    cell = cell.strip()
    return cell[1:-1] if cell.startswith("`") and cell.endswith("`") else cell


def default_text(field: dataclasses.Field) -> str:
    """How the README writes a field's default."""
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        return f"{type(value).__name__}()" if dataclasses.is_dataclass(value) else json.dumps(value)
    value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _config_classes() -> dict[str, type]:
    from flashckpt_integrations import CheckpointerConfig, Layout, RetentionPolicy

    return {"CheckpointerConfig": CheckpointerConfig, "Layout": Layout, "RetentionPolicy": RetentionPolicy}


def expected_rows(cls: type) -> list[tuple[str, str]]:
    return [(f.name, default_text(f)) for f in dataclasses.fields(cls)]


def environment_variables() -> list[str]:
    from flashckpt_integrations import knobs

    names = vars(knobs).items()
    return sorted(v for k, v in names if k.isupper() and isinstance(v, str) and v.startswith("FLASHCKPT_"))


@pytest.mark.parametrize("name", ["CheckpointerConfig", "Layout", "RetentionPolicy"])
def test_config_table_matches_the_code(name: str) -> None:
    rows = _table("README.md", "config-table", name)
    documented = [(_code(r[0]), _code(r[1])) for r in rows]
    expected = expected_rows(_config_classes()[name])
    assert documented == expected, (
        f"README.md's {name} table must list every field in order with its default: expected\n"
        + "\n".join(f"| `{n}` | `{d}` | ... |" for n, d in expected))
    for row in rows:
        assert len(row) >= 3 and row[2], f"{name}.{_code(row[0])}: say what the field does"


def test_environment_table_matches_knobs() -> None:
    rows = _table("README.md", "env-table", "")
    documented = sorted(_code(r[0]) for r in rows)
    assert documented == environment_variables(), (
        f"README.md's environment table lists {documented}; flashckpt_integrations/knobs.py defines "
        f"{environment_variables()}")
    for row in rows:
        assert len(row) >= 3 and row[1] and row[2], f"{_code(row[0])}: give its default and what it does"


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    for cls_name, cls in _config_classes().items():
        print(f"<!-- config-table: {cls_name} -->")
        for field_name, default in expected_rows(cls):
            print(f"| `{field_name}` | `{default}` | |")
        print()
    print("<!-- env-table -->")
    for var in environment_variables():
        print(f"| `{var}` | | |")
