#!/usr/bin/env bash
# Build the API reference (docs/api/index.html) from the docstrings with pdoc; any broken
# cross-reference or pdoc warning fails it. Needs the `docs` extra (part of `test`):
#   bash scripts/build_docs.sh [--out DIR] [--check-only]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" scripts/build_docs.py "$@"
