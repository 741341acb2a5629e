#!/usr/bin/env bash
# Usage: scripts/setup-locked.sh VENV LOCK. Create VENV with lightning-repro (extras test, plot, stats) and the exact
# pins of LOCK (a pip constraints file): the environments beside .venv, built by scripts/setup-min.sh (.venv-min)
# and scripts/setup-new.sh (.venv-new). Cached: rebuilt only when VENV is missing or when the lock, the project's
# dependencies or the Python changed (their SHA-256 is kept in VENV/.stamp, written last, so an interrupted build
# is redone).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$1"
LOCK="$2"
PYTHON="${PYTHON:-python3}"
stamp="$("$PYTHON" - "$LOCK" <<'PY'
import hashlib, sys
try:
    import tomllib  # Python 3.11+: hash only what pip installs from pyproject.toml
    with open("pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    deps = repr((project["dependencies"], extras["test"], extras["plot"], extras["stats"]))
except ImportError:
    with open("pyproject.toml") as f:
        deps = f.read()
with open(sys.argv[1], "rb") as f:
    print(hashlib.sha256(f.read() + deps.encode() + sys.version.encode()).hexdigest())
PY
)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.stamp" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
bash scripts/pip.sh "$VENV" -c "$LOCK" setuptools
bash scripts/pip.sh "$VENV" --no-build-isolation -c "$LOCK" -e ".[test,plot,stats]"
echo "$stamp" > "$VENV/.stamp"
