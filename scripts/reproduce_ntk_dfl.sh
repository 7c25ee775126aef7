#!/bin/bash
# NTK-DFL acceptance runs (issue 4): seeds 0-2 x {alpha=0.1, alpha=0.5, IID}, each stopped at the first
# round with 85 % aggregated accuracy or at the paper's rounds-to-85 % + 25 %. Re-running skips finished
# runs and resumes interrupted ones from their last checkpoint. Usage: bash scripts/reproduce_ntk_dfl.sh [OUT]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-runs/repro2}
mkdir -p "$OUT"
run() {  # name variant rounds seed
  local dir=$OUT/$1_s$4
  [ -f "$dir/summary.json" ] && return 0
  local resume=""; [ -d "$dir/checkpoints" ] && resume="--resume"
  .venv/bin/python experiments/main.py --config=configs/ntk_dfl.py:$2 --config.rounds=$3 --config.seed=$4 \
    --config.eval.stop_at=0.85 --workdir="$dir" $resume > "$dir.log" 2>&1 || echo "run $dir failed (see $dir.log)"
}
for seed in 0 1 2; do
  run a0.1 alpha0.1 22 $seed
  run a0.5 alpha0.5 21 $seed
  run iid iid 15 $seed
done
.venv/bin/python experiments/summarize_runs.py "$OUT"/*_s? --plot docs/figures/ntk_dfl_acceptance.png
