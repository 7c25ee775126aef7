#!/bin/bash
# One prepared command for a lent GPU: the GPU benchmark table, then as many of the figure campaign's
# GPU runs as the time left allows, everything written as a few files under OUT.
#
#   benchmarks/gpu_campaign.sh OUT SECONDS [ITEM ...] [-- ITEM ... [-- ITEM ...]]
#
#   OUT      folder for the results: gpu_check.json / .log (benchmarks/gpu_check.py), campaign.log,
#            runs.tgz.aa, .ab, ... (one archive in 15 MiB pieces: each finished run's config, metrics,
#            summary and log, and the queues' logs; no checkpoints or plots) and results.tgz (the rendered tables and figures of the experiments touched)
#   SECONDS  the wall-clock budget of the whole script; a campaign run that cannot finish inside it is
#            stopped (it is lost: its checkpoints stay on the machine) and the files are still written
#   ITEM     EXPERIMENT=PATTERN[,PATTERN...][@CHUNK]: one `ntk-fl reproduce EXPERIMENT --variants
#            PATTERN...` queue, run with --config.chunk_size=CHUNK (default 0: every client in one vmap,
#            the GPU's best where the device memory allows). Give a smaller chunk where a run's
#            per-client arrays are large: the compressed NTK-DFL runs (explicit N x C x d Jacobians per
#            client) and the CNN. On an H200 the CNN round at chunk 10 stopped with
#            CUDA_ERROR_ILLEGAL_ADDRESS and the compressed runs at chunk 0 ran out of device memory
#            (229 GiB of temporaries for 300 clients). Chunks that fit an H200 (benchmarks/RESULTS.md,
#            "Compressed NTK-DFL"): ntk_dfl:fig15=fig15_compressed@100, ntk_dfl:fig16=fig16_*@100,
#            ntk_dfl:fig15=fig15_topk_bits_sub@25, ntk_dfl:fig15=fig15_topk@4,
#            ntk_dfl:fig15=fig15_topk_bits@4
#            Every run also gets --config.cost_estimate=false: the runs' costs are known, and the
#            estimate before round 1 compiles a calibration step of its own (on an H200 shared by eight
#            lanes 60 s of a 195 s paper-scale NTK-DFL run, benchmarks/RESULTS.md); it changes no
#            result, and a run is matched and resumed with or without it.
#   --       starts another lane. Lanes run side by side on the one device, each its items in order; a
#            lane of cheap runs (the gradient baselines leave most of the device idle) beside one of
#            NTK runs uses the device better than one queue, and the runs' compilations, which take
#            the host's CPUs, overlap the others' rounds. Keep the lanes' runs apart: two lanes must
#            not name the same run. With several lanes each process may take 1/LANES of the device's
#            memory (less 10 %), allocated as needed rather than up front.
#
# Environment: PYTHON (default python3), GPU_CHECK_ARGS (default: the cases this script's table needs;
# "none" skips the table), NTK_FL_DATA_DIR (where the data sets are; nothing is downloaded). Run from
# the repository root.
set -u
set -f # the items' patterns are for the queue, not for the shell
USAGE="usage: gpu_campaign.sh OUT SECONDS [EXPERIMENT=PATTERN[,PATTERN...][@CHUNK] ...] [-- ...]"
OUT=${1:?$USAGE}
BUDGET=${2:?$USAGE}
shift 2
START=$(date +%s)
PY=${PYTHON:-python3}
RUNS=${RUNS_DIR:-/tmp/gpu_campaign_runs}
RESULTS=$RUNS/results
RESERVE=25 # seconds kept for packing the files
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT" "$RUNS" "$RESULTS"
left() { echo $((BUDGET - ($(date +%s) - START) - RESERVE)); }
say() { echo "$(date '+%F %T') [$(($(date +%s) - START)) s] $*" | tee -a "$OUT/campaign.log"; }

# The items, split into lanes at each "--".
lanes=("")
for arg in "$@"; do
  if [[ $arg == -- ]]; then
    lanes+=("")
  elif [[ $arg != *=* ]]; then
    echo "error: item '$arg' is not EXPERIMENT=PATTERN[,PATTERN...][@CHUNK]" >&2
    exit 2
  else
    lanes[-1]+="$arg "
  fi
done

say "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo none)"
if ! $PY -c "import jax, ntk_fl; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/campaign.log"; then
  say "error: the package does not import with $PY; nothing run"
  exit 2
fi

# The benchmark table: NTK-DFL and SPARK at chunk 0, DFedAvg, seed-batched rounds, the CNN round.
GPU_CHECK_ARGS=${GPU_CHECK_ARGS:---cases ntk_dfl,spark,dfedavg,replicas_dfedavg,replicas_ntk_dfl,ntk_dfl_cnn --chunks 0 --replicas 4 --cnn_chunks 10 --repeats 2 --timeout 150}
if [[ $GPU_CHECK_ARGS != none ]]; then
  say "gpu_check.py $GPU_CHECK_ARGS"
  # shellcheck disable=SC2086
  timeout "$(($(left) > 30 ? $(left) : 30))" $PY benchmarks/gpu_check.py $GPU_CHECK_ARGS \
    --json "$OUT/gpu_check.json" > "$OUT/gpu_check.log" 2>&1
  say "gpu_check.py exit $?"
fi

run_lane() { # lane number, then its items
  local lane=$1 item name rest pattern chunk budget patterns
  shift
  for item in "$@"; do
    name=${item%%=*}
    rest=${item#*=}
    pattern=${rest%@*}
    chunk=0
    [[ $rest == *@* ]] && chunk=${rest##*@}
    budget=$(left)
    if ((budget < 60)); then
      say "lane $lane: skipped $name $pattern: $budget s left"
      continue
    fi
    IFS=, read -ra patterns <<< "$pattern"
    say "lane $lane: reproduce $name --variants ${patterns[*]} (chunk $chunk, at most $budget s)"
    timeout "$budget" $PY -m ntk_fl reproduce "$name" --variants "${patterns[@]}" \
      --out "$RUNS" --render_dir "$RESULTS" "--extra=--config.chunk_size=$chunk --config.cost_estimate=false" \
      >> "$RUNS/lane$lane.log" 2>&1
    say "lane $lane: reproduce $name $pattern exit $?"
  done
}

if ((${#lanes[@]} > 1)); then
  # Each lane's processes share the device: a fraction of its memory each, taken as needed.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  XLA_PYTHON_CLIENT_MEM_FRACTION=$(awk -v n=${#lanes[@]} 'BEGIN { printf "%.3f", 0.9 / n }')
  export XLA_PYTHON_CLIENT_MEM_FRACTION
  say "${#lanes[@]} lanes, device memory fraction $XLA_PYTHON_CLIENT_MEM_FRACTION each"
fi
for k in "${!lanes[@]}"; do
  # shellcheck disable=SC2086
  run_lane "$k" ${lanes[$k]} &
done
wait

# Finished runs travel back whole (a summary.json marks one) but for their checkpoints; of the others,
# only the logs (a failed run's console log beside its folder, its log.txt, the lanes' logs), to say why.
(cd "$RUNS" && {
  find . -maxdepth 3 -name summary.json -printf '%h\n' | sort -u
  find . -maxdepth 2 \( -name '*.log' -o -name log.txt \) -print
} > packed.txt)
say "finished runs: $(find "$RUNS" -maxdepth 3 -name summary.json | wc -l)"
# The per-run plots and TensorBoard events repeat metrics.jsonl; the archive is cut into 15 MiB pieces
# (runs.tgz.aa, .ab, ...: `cat runs.tgz.* | tar xz`), under the size a file may have to travel back.
tar czf - -C "$RUNS" --exclude='checkpoints' --exclude='*.lock' --exclude='events.out.*' \
  --exclude='*.png' --exclude='*.pdf' -T "$RUNS/packed.txt" 2>> "$OUT/campaign.log" |
  split -b 15M - "$OUT/runs.tgz."
tar czf "$OUT/results.tgz" -C "$RUNS" results 2>> "$OUT/campaign.log"
say "done"
