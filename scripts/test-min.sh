#!/usr/bin/env bash
# The lowest supported versions (requirements/lock-min.txt, in .venv-min): the fast tests and a resume smoke test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-min.sh
exec bash scripts/test-locked.sh .venv-min "$@"
