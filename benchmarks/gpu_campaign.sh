#!/bin/bash
# One prepared command for a lent GPU: the GPU benchmark table, then as many of the figure campaign's
# GPU runs as the time left allows, everything written as a few files under OUT.
#
#   benchmarks/gpu_campaign.sh OUT SECONDS [EXPERIMENT=VARIANT_PATTERN[@CHUNK] ...]
#
#   OUT      folder for the results: gpu_check.json / .log (benchmarks/gpu_check.py), campaign.log,
#            runs.tgz (each finished run's config, metrics and summary; no checkpoints) and
#            results.tgz (the rendered tables and figures of the experiments touched)
#   SECONDS  the wall-clock budget of the whole script; a campaign run that cannot finish inside it is
#            stopped (it is lost: its checkpoints stay on the machine) and the files are still written
#   EXPERIMENT=PATTERN[@CHUNK]  one `ntk-fl reproduce EXPERIMENT --variants PATTERN` queue, run with
#            --config.chunk_size=CHUNK (default 0: every client in one vmap, the GPU's best where the
#            device memory allows). Give a smaller chunk where a run's per-client arrays are large:
#            the compressed NTK-DFL runs (explicit N x C x d Jacobians per client) and the CNN. On an
#            H200 the CNN round at chunk 10 stopped with CUDA_ERROR_ILLEGAL_ADDRESS and the compressed
#            runs at chunk 0 ran out of device memory (229 GiB of temporaries for 300 clients). Chunks
#            that fit an H200 (benchmarks/RESULTS.md, "Compressed NTK-DFL"): ntk_dfl:fig15=fig15_compressed@100,
#            ntk_dfl:fig16=fig16_*@100, ntk_dfl:fig15=fig15_topk_bits_sub@25, ntk_dfl:fig15=fig15_topk@4,
#            ntk_dfl:fig15=fig15_topk_bits@4
#
# Environment: PYTHON (default python3), GPU_CHECK_ARGS (default: the cases this script's table needs),
# NTK_FL_DATA_DIR (where the data sets are; nothing is downloaded). Run from the repository root.
set -u
OUT=${1:?usage: gpu_campaign.sh OUT SECONDS [EXPERIMENT=PATTERN[@CHUNK] ...]}
BUDGET=${2:?usage: gpu_campaign.sh OUT SECONDS [EXPERIMENT=PATTERN[@CHUNK] ...]}
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

say "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo none)"
if ! $PY -c "import jax, ntk_fl; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/campaign.log"; then
  say "error: the package does not import with $PY; nothing run"
  exit 2
fi

# The benchmark table: NTK-DFL and SPARK at chunk 0, DFedAvg, seed-batched rounds, the CNN round.
GPU_CHECK_ARGS=${GPU_CHECK_ARGS:---cases ntk_dfl,spark,dfedavg,replicas_dfedavg,replicas_ntk_dfl,ntk_dfl_cnn --chunks 0 --replicas 4 --cnn_chunks 10 --repeats 2 --timeout 150}
say "gpu_check.py $GPU_CHECK_ARGS"
# shellcheck disable=SC2086
timeout "$(($(left) > 30 ? $(left) : 30))" $PY benchmarks/gpu_check.py $GPU_CHECK_ARGS \
  --json "$OUT/gpu_check.json" > "$OUT/gpu_check.log" 2>&1
say "gpu_check.py exit $?"

for item in "$@"; do
  name=${item%%=*}
  rest=${item#*=}
  pattern=${rest%@*}
  chunk=0
  [[ $rest == *@* ]] && chunk=${rest##*@}
  budget=$(left)
  if ((budget < 60)); then
    say "skipped $name $pattern: $budget s left"
    continue
  fi
  say "reproduce $name --variants $pattern (chunk $chunk, at most $budget s)"
  timeout "$budget" $PY -m ntk_fl reproduce "$name" --variants "$pattern" --out "$RUNS" \
    --render_dir "$RESULTS" "--extra=--config.chunk_size=$chunk" >> "$OUT/campaign.log" 2>&1
  say "reproduce $name $pattern exit $?"
done

# Finished runs travel back whole (a summary.json marks one) but for their checkpoints; of the others,
# only the logs (a failed run's console log beside its folder, and its log.txt), to say why.
(cd "$RUNS" && {
  find . -maxdepth 3 -name summary.json -printf '%h\n' | sort -u
  find . -maxdepth 2 \( -name '*.log' -o -name log.txt \) -print
} > packed.txt)
say "finished runs: $(find "$RUNS" -maxdepth 3 -name summary.json | wc -l)"
tar czf "$OUT/runs.tgz" -C "$RUNS" --exclude='checkpoints' --exclude='*.lock' -T "$RUNS/packed.txt" 2>> "$OUT/campaign.log"
tar czf "$OUT/results.tgz" -C "$RUNS" results 2>> "$OUT/campaign.log"
say "done"
