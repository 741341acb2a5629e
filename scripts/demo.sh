#!/usr/bin/env bash
# Set up the pinned environment and run the demos: kill training runs mid-epoch, resume them, compare.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/resume_demo.py "$@"
.venv/bin/python examples/ordinary_project.py
