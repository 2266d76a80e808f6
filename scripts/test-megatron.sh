#!/usr/bin/env bash
# The Megatron-LM tests, in their own virtualenv: Megatron-LM's `megatron.training` ships with
# megatron-core >= 0.19, which needs Python >= 3.12 (there is no CPU torch wheel for it here, so
# torch 2.14.1 comes from the registry: a CUDA build that runs on the CPU). Extra args go to pytest.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${FLASHCKPT_MEGATRON_VENV:-.venv-megatron}
if [[ ! -x "$VENV/bin/python" ]]; then
    PY=""
    for candidate in python3.12 python3.13; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys' 2>/dev/null; then
            PY=$candidate; break
        fi
    done
    if [[ -z "$PY" ]] && command -v pyenv >/dev/null 2>&1; then
        version=$(pyenv versions --bare | grep -E '^3\.1[23]\.' | head -n 1 || true)
        [[ -n "$version" ]] && PY="$(pyenv root)/versions/$version/bin/python"
    fi
    if [[ -z "$PY" ]]; then
        echo "ERROR: the Megatron tests need Python >= 3.12 (megatron-core 0.19); none was found" >&2
        exit 1
    fi
    echo ">>> creating $VENV with $("$PY" --version 2>&1)"
    "$PY" -m venv "$VENV"
fi

"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.14.1          # first, so nothing resolves another build
# psutil: Megatron's async save; only what tests/megatron needs (the test extra pulls HF, TRL, moto)
"$VENV/bin/python" -m pip install -q 'megatron-core==0.19.2' psutil pytest pytest-timeout -e .

export PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/megatron "$@"
