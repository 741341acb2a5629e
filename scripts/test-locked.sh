#!/usr/bin/env bash
# Usage: scripts/test-locked.sh VENV [PYTEST ARGS]. The fast tests (two workers, as the main suite: 66 s where one
# took 88) and a resume smoke test in VENV (built by scripts/test-min.sh and scripts/test-new.sh before they call this).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$1"
shift
"$VENV/bin/python" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not ddp and not streaming and not sharded and not launchers and not features" "$@"
# killed mid-epoch, killed after a checkpoint on an epoch's last batch (the loop-counter
# corrections), and an ordinary project resumed from on_train_epoch_end (workers,
# the hook replay of _lightning.py)
"$VENV/bin/python" -m pytest -q "$@" \
  "tests/test_resume.py::test_killed_process_resumes_bitwise[mid-epoch-0]" \
  "tests/test_resume.py::test_killed_process_resumes_bitwise[last-batch-2]" \
  "tests/test_ordinary_project.py::test_killed_project_continues_exactly[train-epoch-end-plateau]"
