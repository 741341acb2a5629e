#!/usr/bin/env bash
# Set up the pinned environment, lint and type-check the package, build the docs, and run the whole test suite;
# without arguments, then the fast tests and a resume smoke test on the lowest supported versions (scripts/test-min.sh)
# and on the newest torch (scripts/test-new.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check lightning_repro tests benchmarks examples
.venv/bin/mypy
# the documentation site, offline, into site/ (gitignored): a broken link or API reference fails (about 10 s)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict  # not --quiet: it hides the warnings, and strict then passes
# the main suite: two workers, a file per worker (its reference runs shared), the longest files first (conftest.py)
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not ddp and not streaming and not sharded and not launchers and not features" "$@"
if [ $# -eq 0 ]; then
  # the marked tests, whose jobs are long: the DDP jobs, streaming libraries, sharded training, the DDP cases under
  # torchrun and two loopback nodes, the Lightning features and in-flight checkpoints, in one run (the two workers
  # share the files, the longest first: 9:17 here where the five stages one after the other took 10:39)
  .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "ddp or streaming or sharded or launchers or features"
  bash scripts/test-min.sh
  bash scripts/test-new.sh
fi
