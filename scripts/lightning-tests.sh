#!/usr/bin/env bash
# Run Lightning's own tests (the folders of tests/tests_pytorch in DEFAULT_TESTS below) with DeterminismCallback(seed=0)
# injected into every Trainer through Lightning's `lightning.pytorch.callbacks_factory` entry point, and check the
# outcomes against the allowed failures in scripts/lightning_tests.py (exit 1 on any other failure).
#
#   bash scripts/lightning-tests.sh LIGHTNING_SRC [--plain] [PYTEST_ARGS...]
#
# LIGHTNING_SRC: a Lightning source checkout at tag 2.6.5 (its tests/ and requirements/ are used; the Lightning that
# runs is the installed 2.6.6 of requirements/lock-lt.txt). --plain: the same tests without the callback (a baseline).
# PYTEST_ARGS replace the default folders (e.g. tests/tests_pytorch/loops/test_loops.py -k parity). The tests run in
# .venv-lt (built here, pinned by requirements/lock-lt.txt: Lightning's tests pin numpy and pytest differently from
# requirements/lock.txt), so neither .venv nor our own test suite sees Lightning's test requirements or the entry
# point: it is declared in a temporary *.dist-info put on PYTHONPATH for this run only. Results in
# build/lightning-tests/ (results.json, pytest.log), the working directory of the tests there too. Run it in the
# foreground or in the background with `&`, not under `nohup`: nohup ignores SIGHUP, and Lightning's
# test_auto_requeue_custom_signal_flag[SIGHUP] cases expect its default handler.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
if [ $# -lt 1 ] || [ ! -d "$1/tests/tests_pytorch" ]; then
  echo "usage: bash scripts/lightning-tests.sh LIGHTNING_SRC [--plain] [PYTEST_ARGS...]" >&2
  echo "  LIGHTNING_SRC: a Lightning source checkout (tag 2.6.5) with tests/tests_pytorch; got: ${1:-nothing}" >&2
  exit 2
fi
SRC="$(cd "$1" && pwd)"
shift
PLAIN=0
if [ "${1:-}" = "--plain" ]; then
  PLAIN=1
  shift
fi
PYTHON="${PYTHON:-python3}"
LOCK=requirements/lock-lt.txt

# .venv-lt: rebuilt only when missing or when the lock, Lightning's test requirements (test.txt and extra.txt, as
# Lightning's CI installs them) or the Python changed
stamp="$(cat "$LOCK" "$SRC/requirements/pytorch/test.txt" "$SRC/requirements/pytorch/extra.txt" pyproject.toml | "$PYTHON" -c \
  'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read() + sys.version.encode()).hexdigest())')"
if [ ! -x .venv-lt/bin/python ] || [ "$(cat .venv-lt/.stamp 2>/dev/null)" != "$stamp" ]; then
  rm -rf .venv-lt
  "$PYTHON" -m venv .venv-lt
  bash scripts/pip.sh .venv-lt -c "$LOCK" setuptools
  bash scripts/pip.sh .venv-lt --no-build-isolation -c "$LOCK" \
    torch lightning -r "$SRC/requirements/pytorch/test.txt" -r "$SRC/requirements/pytorch/extra.txt" -e .
  echo "$stamp" > .venv-lt/.stamp
fi

OUT="$ROOT/build/lightning-tests"
rm -rf "$OUT"
mkdir -p "$OUT/cwd"
SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
if [ "$PLAIN" = 0 ]; then
  # what an installed distribution declaring the entry point would hold; importlib.metadata finds it on sys.path
  mkdir "$SITE/lightning_repro_lightning_tests-0.dist-info"
  printf 'Metadata-Version: 2.1\nName: lightning-repro-lightning-tests\nVersion: 0\n' \
    > "$SITE/lightning_repro_lightning_tests-0.dist-info/METADATA"
  printf '[lightning.pytorch.callbacks_factory]\nlightning_repro = lightning_tests:callbacks\n' \
    > "$SITE/lightning_repro_lightning_tests-0.dist-info/entry_points.txt"
fi
# the folders and files of tests/tests_pytorch run by default (about 20 min on 2 cores: docs/development.md)
DEFAULT_TESTS=(
  loops checkpointing tuner callbacks models/test_hooks.py models/test_restore.py models/test_hparams.py trainer/flags
  trainer/logging_
  trainer/connectors trainer/optimization accelerators/test_cpu.py
)
if [ $# -eq 0 ]; then
  set -- "${DEFAULT_TESTS[@]/#/$SRC/tests/tests_pytorch/}"
fi
EXTRA=()
if ! compgen -G "$SRC/tests/legacy/checkpoints/*/*.ckpt" > /dev/null; then
  # Lightning's CI downloads the checkpoints of old releases into tests/legacy/checkpoints; a source checkout has none
  EXTRA+=(--ignore="$SRC/tests/tests_pytorch/checkpointing/test_legacy_checkpoints.py")
  echo "no legacy checkpoints in $SRC/tests/legacy/checkpoints: checkpointing/test_legacy_checkpoints.py not run"
fi
echo "Lightning's tests from $SRC on $(.venv-lt/bin/python -c 'import lightning; print(lightning.__version__)')," \
  "$([ "$PLAIN" = 1 ] && echo 'plain (no callback)' || echo 'DeterminismCallback(seed=0) injected'); log: $OUT/pytest.log"
start=$(date +%s)
# Lightning's pytest configuration (its pyproject.toml); the tests' working directory is a scratch folder, so files a
# test writes to the current directory land there, not in Lightning's checkout or ours
rc=0
(cd "$OUT/cwd" && PYTHONPATH="$SITE:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}" LIGHTNING_TESTS_RESULTS="$OUT/results.json" \
  "$ROOT/.venv-lt/bin/python" -m pytest -c "$SRC/pyproject.toml" --rootdir "$SRC" -p lightning_tests \
  -p no:cacheprovider --timeout=600 --color=no -q -rfE ${EXTRA[@]+"${EXTRA[@]}"} "$@") > "$OUT/pytest.log" 2>&1 || rc=$?
echo "pytest exited $rc after $(( $(date +%s) - start )) s"
tail -n 3 "$OUT/pytest.log"
if [ ! -f "$OUT/results.json" ]; then
  echo "no results: pytest did not finish (see $OUT/pytest.log)" >&2
  exit 1
fi
if [ "$PLAIN" = 1 ]; then
  .venv-lt/bin/python scripts/lightning_tests.py check "$OUT/results.json" || true  # a baseline: nothing to enforce
  exit 0
fi
exec .venv-lt/bin/python scripts/lightning_tests.py check "$OUT/results.json"
