#!/usr/bin/env bash
# Install (torch first!) and run the test suite.  Extra args go to pytest.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=python
command -v "$PY" >/dev/null 2>&1 || PY=python3

export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export PYTHONUNBUFFERED=1

"$PY" -m pip install torch==2.13.0
# s3fs next: its aiobotocore pins botocore to a few releases; moto's boto3 is then chosen to match,
# instead of pip walking back through hundreds of botocore releases (GBs of downloads)
"$PY" -m pip install 's3fs>=2024.3'
botocore=$("$PY" -m pip show botocore | awk '/^Version:/ {print $2}')
DS_BUILD_OPS=0 "$PY" -m pip install -e '.[test,hf,deepspeed]' "botocore==$botocore"

rc=0
"$PY" -m pytest -q -p no:cacheprovider tests "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "ERROR: pytest collected no tests (exit code 5); treating as failure" >&2
fi

# Megatron-LM's checkpointing needs megatron-core 0.19 on Python >= 3.12: its own virtualenv.
mrc=0
if [[ "${FLASHCKPT_SKIP_MEGATRON:-0}" != 1 ]]; then
    bash scripts/test-megatron.sh || mrc=$?
    if [[ $mrc -eq 5 ]]; then
        echo "ERROR: the Megatron tests collected nothing (exit code 5); treating as failure" >&2
    fi
fi
[[ $rc -ne 0 ]] && exit "$rc"
exit "$mrc"
