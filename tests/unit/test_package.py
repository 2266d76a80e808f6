"""Import hygiene and the public surface."""

import subprocess
import sys

import flashckpt_integrations as fc


def test_import_needs_torch_only():
    code = (
        "import sys\n"
        "for name in ('transformers', 'accelerate', 'deepspeed', 'megatron', 'safetensors', 'fsspec', 's3fs'):\n"
        "    sys.modules[name] = None\n"
        "import flashckpt_integrations, flashckpt_integrations.core.engine, flashckpt_integrations.core.saver\n"
        "import flashckpt_integrations.cli\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_numpy_is_a_dependency_and_the_cli_starts_without_a_numpy_warning():
    # torch 2.13 warns "Failed to initialize NumPy" at every `import torch` when numpy is absent (its
    # wheel does not require numpy): every process of ours (flashckpt, the saver, the demo) imports
    # torch, so the package must bring numpy along.
    import configparser
    import importlib.metadata
    import os
    import re

    from tests.helpers import REPO

    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"))
    assert "numpy" in re.findall(r"^\s*([A-Za-z0-9_.-]+)", setup["options"]["install_requires"], re.M)
    installed = importlib.metadata.requires("flashckpt-integrations") or []
    assert any(re.match(r"numpy\b", r) and "extra ==" not in r for r in installed), (
        f"the installed metadata lacks numpy (reinstall with pip install -e .): {installed}")
    commands = [[sys.executable, "-m", "flashckpt_integrations.cli", "--help"]]
    script = os.path.join(os.path.dirname(sys.executable), "flashckpt")
    if os.path.exists(script):
        commands.append([script, "--help"])
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 0 and "usage: flashckpt" in done.stdout, done.stderr
        assert "NumPy" not in done.stderr and "Warning" not in done.stderr, done.stderr


def test_reexports_are_the_implementation_objects():
    from flashckpt_integrations.config import CheckpointerConfig
    from flashckpt_integrations.core.engine import Checkpointer, SaveStatus
    from flashckpt_integrations.core.retention import RetentionPolicy
    from flashckpt_integrations.errors import FlashCkptError

    assert fc.Checkpointer is Checkpointer and fc.SaveStatus is SaveStatus
    assert fc.CheckpointerConfig is CheckpointerConfig and fc.RetentionPolicy is RetentionPolicy
    assert fc.FlashCkptError is FlashCkptError
    assert set(fc.__all__) == {n for n in fc.__all__ if hasattr(fc, n)}


def test_missing_fsspec_says_what_to_install():
    code = (
        "import sys\nsys.modules['fsspec'] = None\n"
        "from flashckpt_integrations.core.storage import storage_from_url\n"
        "try:\n    storage_from_url('s3://bucket/x')\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'flashckpt-integrations[s3]'" in done.stdout, done.stderr


def test_config_validation_says_how_to_fix():
    import pytest

    with pytest.raises(ValueError, match="commit_timeout_s"):
        fc.CheckpointerConfig(commit_timeout_s=0)
    with pytest.raises(ValueError, match="step"):
        fc.Layout(step_dir="checkpoints")
