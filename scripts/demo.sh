#!/usr/bin/env bash
# Set up the pinned environment and run the demo: kill a training run mid-epoch, resume it, compare.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/resume_demo.py "$@"
