#!/usr/bin/env bash
# Installs, builds and runs the whole test suite. GPU tests run when a GPU is present and
# are reported as skipped (with the reason) when not.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/build.sh
$PY -m pip install -q -r requirements-test.txt
$PY -m pytest tests -ra -q "$@"
