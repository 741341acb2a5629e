#!/usr/bin/env bash
# Create .venv (if needed) and install lightning-repro with the exact pins of requirements/lock.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c requirements/lock.txt setuptools
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation \
  -c requirements/lock.txt -e ".[test,dev,plot,stats,docs]"
