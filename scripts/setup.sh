#!/usr/bin/env bash
# Create .venv (if needed) and install lightning-repro with the exact pins of requirements/lock.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
bash scripts/pip.sh .venv -c requirements/lock.txt setuptools
bash scripts/pip.sh .venv --no-build-isolation -c requirements/lock.txt -e ".[test,dev,plot,stats,docs,streaming]"
# litdata (the streaming tests) requires torchvision, which would pull another torch: installed without its
# dependencies, with what it imports on a local directory (boto3 at import; filelock, requests, urllib3,
# lightning-utilities are there already), all pinned in requirements/lock.txt
bash scripts/pip.sh .venv --no-deps -c requirements/lock.txt litdata boto3 botocore s3transfer jmespath
