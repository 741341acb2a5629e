#!/usr/bin/env bash
# Install into a virtual environment: `bash scripts/pip.sh VENV PIP-INSTALL-ARGUMENTS...`.
#
# With uv (pinned in requirements/lock-tools.txt, bootstrapped once into .venv-uv with pip): the same pins, the same
# indexes and find-links as pip's configuration here (read from `pip config list`, so a machine's local index and
# caps apply alike), byte-compiled like pip's installs; several times faster than pip (parallel unpacking; a 5.8 GB
# CUDA torch in about a minute). LIGHTNING_REPRO_INSTALLER=pip, or a uv that cannot be bootstrapped, uses pip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$1"
shift
PYTHON="${PYTHON:-python3}"
pip_install() {
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}
if [ "${LIGHTNING_REPRO_INSTALLER:-uv}" = "pip" ]; then
  pip_install "$@"
  exit 0
fi
if [ ! -x .venv-uv/bin/uv ]; then
  rm -rf .venv-uv
  if ! { "$PYTHON" -m venv .venv-uv && .venv-uv/bin/python -m pip install -qq --disable-pip-version-check \
    -c requirements/lock-tools.txt uv; }; then
    echo "scripts/pip.sh: uv could not be installed; installing with pip" >&2
    rm -rf .venv-uv
    pip_install "$@"
    exit 0
  fi
fi
# pip's index, extra indexes, find-links and constraints (its config files and PIP_* variables), as uv's options
mapfile -t sources < <("$PYTHON" - <<'PY'
import ast, subprocess, sys

out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
options = {}
for line in out.splitlines():
    key, _, value = line.partition("=")
    name = key.rsplit(".", 1)[-1]
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        continue
    if key.startswith(":env:") or name not in options:  # PIP_* variables win over the files, as in pip
        options[name] = value.split()
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
for name, flag in flags.items():
    for value in options.get(name, []):
        print(flag)
        print(value)
PY
)
.venv-uv/bin/uv pip install --quiet --python "$VENV/bin/python" --compile-bytecode \
  --index-strategy unsafe-best-match "${sources[@]}" "$@"
