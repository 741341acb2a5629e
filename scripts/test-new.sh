#!/usr/bin/env bash
# The newest torch this machine offers (requirements/lock-new.txt, in .venv-new): the fast tests and a resume smoke
# test, as scripts/test-min.sh runs them on the lowest versions.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-new.sh
exec bash scripts/test-locked.sh .venv-new "$@"
