#!/usr/bin/env bash
# Create .venv-min: lightning-repro with the lowest supported Lightning, pinned by requirements/lock-min.txt.
# Cached: rebuilt only when it is missing or when the lock, the project's dependencies or the Python changed
# (their SHA-256 is kept in .venv-min/.stamp, written last, so an interrupted build is redone).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOCK=requirements/lock-min.txt
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
if [ -x .venv-min/bin/python ] && [ "$(cat .venv-min/.stamp 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
rm -rf .venv-min
"$PYTHON" -m venv .venv-min
.venv-min/bin/python -m pip install --quiet --disable-pip-version-check -c "$LOCK" setuptools
.venv-min/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -c "$LOCK" -e ".[test,plot,stats]"
echo "$stamp" > .venv-min/.stamp
