#!/usr/bin/env bash
# Create .venv-new: lightning-repro with the newest torch this machine offers (2.14.1, a CUDA build that runs on the
# CPU) and the newest of the rest, pinned by requirements/lock-new.txt (cached, see scripts/setup-locked.sh).
set -euo pipefail
exec bash "$(dirname "$0")/setup-locked.sh" .venv-new requirements/lock-new.txt
