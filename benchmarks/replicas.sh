#!/usr/bin/env bash
# Seed-batched runs against separate runs: wall time (compilation included) of S seeds of one smoke config,
# as one `--config.replicas=S` run and as S single-seed runs, each a fresh `ntk-fl` process, back to back.
#   benchmarks/replicas.sh [CONFIG [S [PYTHON]]]     e.g. benchmarks/replicas.sh ntk_dfl:smoke 3
set -euo pipefail
config=${1:-dfedavg:smoke}
replicas=${2:-3}
python=${3:-.venv/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
seconds() { local t0; t0=$(date +%s.%N); "$@" >/dev/null 2>&1; echo "$(date +%s.%N) - $t0" | bc; }
together=$(seconds "$python" -m ntk_fl --config="$config" --config.replicas="$replicas" --workdir="$out/together")
apart=0
for ((k = 0; k < replicas; k++)); do
  t=$(seconds "$python" -m ntk_fl --config="$config" --config.seed=$k --workdir="$out/seed$k")
  apart=$(echo "$apart + $t" | bc)
done
printf '%s, %d seeds: replicated %.1f s, separate %.1f s, ratio %.2f\n' \
  "$config" "$replicas" "$together" "$apart" "$(echo "$apart / $together" | bc -l)"
