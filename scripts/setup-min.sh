#!/usr/bin/env bash
# Create .venv-min: lightning-repro with the lowest supported Lightning, pinned by requirements/lock-min.txt
# (cached, see scripts/setup-locked.sh).
set -euo pipefail
exec bash "$(dirname "$0")/setup-locked.sh" .venv-min requirements/lock-min.txt
