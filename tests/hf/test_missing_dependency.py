"""Without transformers, importing the adapter says what to install."""

import importlib
import sys

import pytest

from flashckpt_integrations.errors import MissingDependencyError


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    monkeypatch.delitem(sys.modules, "flashckpt_integrations.adapters.hf_trainer", raising=False)
    with pytest.raises(MissingDependencyError, match=r"pip install 'flashckpt-integrations\[hf\]'"):
        importlib.import_module("flashckpt_integrations.adapters.hf_trainer")
