#!/usr/bin/env bash
# Builds an environment with neural-tangents 0.6.5 (which does not import on the
# library's JAX) and regenerates tests/data/neural_tangents_reference.npz:
#   stage 1 (library environment): parameters and inputs  -> a temporary .npz
#   stage 2 (oracle environment):  neural-tangents kernels -> tests/data/...
# Usage (from anywhere): scripts/nt_oracle/build_references.sh
#   NT_ORACLE_VENV  where the oracle environment lives (default /tmp/nt_oracle; reused when present)
#   LIBRARY_PYTHON  the library environment's python (default .venv/bin/python)
#   ORACLE_PYTHON   the interpreter the oracle venv is made from (default python3; 3.9-3.12)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${NT_ORACLE_VENV:-/tmp/nt_oracle}"
library_python="${LIBRARY_PYTHON:-.venv/bin/python}"

if [ ! -x "$venv/bin/python" ]; then
  "${ORACLE_PYTHON:-python3}" -m venv "$venv"
fi
# neural-tangents 0.6.5 imports tensorflow (through tf2jax) and uses JAX internals that
# later JAX releases removed (jax 0.4.30 already fails in its structured-derivatives NTK).
"$venv/bin/pip" install -q "jax[cpu]==0.4.25" "jaxlib==0.4.25" "numpy==1.26.4" "tensorflow-cpu==2.17.1" \
  "frozendict==2.5.1" "dm-tree==0.1.10" "absl-py==2.5.1"
# Both declare a dependency on the `tensorflow` distribution; `tensorflow-cpu` provides the
# same module without the GPU libraries, so they are installed without dependency resolution.
"$venv/bin/pip" install -q --no-deps "neural-tangents==0.6.5" "tf2jax==0.3.6"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
PYTHONPATH="$PWD" "$library_python" scripts/nt_oracle/export_inputs.py "$tmp/inputs.npz"
TF_CPP_MIN_LOG_LEVEL=2 "$venv/bin/python" scripts/nt_oracle/compute_references.py "$tmp/inputs.npz" \
  tests/data/neural_tangents_reference.npz
