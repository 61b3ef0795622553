#!/usr/bin/env bash
# Installs, builds and runs the main job: a small random GQA decoder that prefills and
# decodes with gqa_torch (GPU when present, else CPU), printing tokens/s and SDPA parity.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ${PYTHON:-python3} examples/tiny_decoder.py "$@"
