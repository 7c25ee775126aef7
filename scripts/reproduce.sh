#!/bin/bash
# The papers' acceptance runs as resumable queues: bash scripts/reproduce.sh SUITE [OUT] [SEEDS]
#
#   ntk_dfl    NTK-DFL: {alpha0.1, alpha0.5, iid} x seeds, stopped at 85 % or at the paper's
#              rounds-to-85 % + 25 % (22 / 21 / 15)
#   ntk_dfl_authors  NTK-DFL on the authors' own partition files (draw 0): {authors_alpha0.1, authors_alpha0.5,
#              authors_iid} x seeds, up to 30 rounds, stopped at 85 %; plus DFedAvg on authors_alpha0.1 and
#              NTK-DFL with the authors' code's lr decay on authors_alpha0.1 (first seed only)
#   baselines  DFedAvg, DFedAvgM, DFedSAM, DisPFL, D-PSGD: the same levels x seeds, each config's
#              own 200 rounds, stopped at 85 %; METHODS="dfedavg dpsgd" and LEVELS="iid alpha0.5" restrict it
#   ntk_fl     NTK-FL and CP-NTK-FL at alpha = 0.1 (NTK-FL Table 1) and FedAvg, stopped at 85 %
#   ntk_fl_busiest   NTK-FL in NTK-DFL App. C.1's busiest-node setting (5 clients per round), {iid, alpha0.5,
#              alpha0.1} x seeds, stopped at 85 % (about 2 min per run)
#   spark      SPARK: {alpha0.1, alpha0.5, iid, alpha0.3} x seeds, 30 rounds (Tables 1-2);
#              LEVELS="alpha0.3" restricts it
#   spark_ablation   the Table 4 rows at IID x seeds, 30 rounds (distillation only and momentum only branch
#              off no distillation and SPARK after the shared 10-round warm-up); ROWS="none distill" restricts
#              it to some of abl_none, abl_both, abl_distill, abl_momentum
#   spark_ntk_dfl   Table 3's baseline: NTK-DFL (SPARK's `abl_none` row, same setting and 30 rounds) at
#              {alpha0.1, alpha0.3, alpha0.5} x seeds, for experiments/paired_test.py against the `spark` runs (the
#              IID pairs are spark_ablation's abl_none runs); LEVELS restricts it
#   spark_comm the Fig. 9/11/12 runs at alpha = 0.1 x seeds, 30 rounds: layer-wise caps 500 and 750 (the cap 1000
#              is the unprojected `spark` run) and the full compression stack; VARIANTS="proj500" restricts it
#
# PYTHON (default .venv/bin/python) may carry a prefix, e.g. PYTHON="taskset -c 1 .venv/bin/python" with
# XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" runs a queue on one core, so that two
# queues share a 2-core machine (benchmarks/RESULTS.md: more runs per hour than one queue on both cores).
#
# EXTRA holds flags added to every run, e.g. EXTRA="--config.chunk_size=0" on a GPU (all clients in one vmap).
#
# OUT defaults to runs/<suite>; SEEDS to "0 1 2". A finished run (its summary.json exists) is skipped and an
# interrupted one resumes from its last checkpoint (one killed before its first checkpoint is moved aside and
# started again), so the same command continues a killed queue. Every run writes its console (progress,
# warnings, result) to OUT/<name>.log and its full log to OUT/<name>/log.txt; the table and the curves come
# from experiments/summarize_runs.py at the end, which
# also archives the finished runs' per-round scalars to ARCHIVE (default docs/runs/<OUT's name>; ARCHIVE= skips
# it): runs/ does not outlive the machine, the archive is committed with the results it backs.
set -u
cd "$(dirname "$0")/.."
SUITE=${1:?usage: bash scripts/reproduce.sh ntk_dfl|ntk_dfl_authors|baselines|ntk_fl|ntk_fl_busiest|spark|spark_ablation|spark_ntk_dfl|spark_comm [OUT] [SEEDS]}
OUT=${2:-runs/$SUITE}
SEEDS=${3:-0 1 2}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"

run() {  # name config[:variants] seed [extra --config.* flags...]
  local name=$1 config=$2 seed=$3; shift 3
  local dir=$OUT/${name}_s$seed
  [ -f "$dir/summary.json" ] && return 0
  local resume=""
  if compgen -G "$dir/checkpoints/[0-9]*" > /dev/null; then
    resume="--resume"
  elif [ -e "$dir" ]; then  # killed before its first checkpoint: nothing to resume, keep it aside, start over
    local aside="$dir.unfinished-$(date +%s)"
    echo "$dir has no checkpoint to resume; moved to $aside" >&2
    mv "$dir" "$aside"
  fi
  echo "$(date '+%F %T') $dir" >&2
  $PYTHON experiments/main.py --config="$config" --config.seed="$seed" --workdir="$dir" $resume "$@" ${EXTRA:-} \
    >> "$dir.log" 2>&1 || echo "run $dir failed (see $dir.log)" >&2
}

branch() {  # name config[:variants] seed source_name [extra flags...]: the run, started from the source run's
            # checkpoint inside the rounds both compute identically (rundir.check_branch), when it has one
  local name=$1 config=$2 seed=$3 source=$OUT/${4}_s$3; shift 4
  if [ ! -e "$OUT/${name}_s$seed" ] && compgen -G "$source/checkpoints/[0-9]*" > /dev/null; then
    run "$name" "$config" "$seed" --branch_from="$source" "$@"
  else
    [ -e "$OUT/${name}_s$seed" ] || echo "$source has no checkpoint to branch from; running $name from round 0" >&2
    run "$name" "$config" "$seed" "$@"
  fi
}

to85="--config.eval.stop_at=0.85"
case "$SUITE" in
  ntk_dfl)
    for s in $SEEDS; do
      run a0.1 configs/ntk_dfl.py:alpha0.1 "$s" --config.rounds=22 $to85
      run a0.5 configs/ntk_dfl.py:alpha0.5 "$s" --config.rounds=21 $to85
      run iid configs/ntk_dfl.py:iid "$s" --config.rounds=15 $to85
    done ;;
  ntk_dfl_authors)
    first=${SEEDS%% *}
    for s in $SEEDS; do
      for level in alpha0.1 alpha0.5 iid; do
        run "ntk_dfl_authors_$level" "configs/ntk_dfl.py:authors_$level" "$s" --config.rounds=30 $to85
      done
    done
    run dfedavg_authors_alpha0.1 configs/dfedavg.py:authors_alpha0.1 "$first" $to85
    run ntk_dfl_authors_alpha0.1_code_decay configs/ntk_dfl.py:authors_alpha0.1,code_decay "$first" \
        --config.rounds=30 $to85 ;;
  baselines)
    for s in $SEEDS; do
      for m in ${METHODS:-dfedavg dfedavgm dfedsam dispfl dpsgd}; do
        [ -f "configs/$m.py" ] || { echo "unknown method '$m' in METHODS (no configs/$m.py)" >&2; exit 2; }
        for level in ${LEVELS:-alpha0.1 alpha0.5 iid}; do run "${m}_$level" "configs/$m.py:$level" "$s" $to85; done
      done
    done ;;
  ntk_fl)
    for s in $SEEDS; do
      run ntk_fl configs/ntk_fl.py "$s" $to85
      run cp_ntk_fl configs/cp_ntk_fl.py "$s" $to85
      run cp_ntk_fl_table1 configs/cp_ntk_fl.py:table1 "$s" $to85
      run fedavg configs/fedavg.py "$s" $to85
    done ;;
  ntk_fl_busiest)
    for s in $SEEDS; do
      for level in iid alpha0.5 alpha0.1; do run "busy_$level" "configs/ntk_fl.py:busiest_node,$level" "$s" $to85; done
    done ;;
  spark)
    for s in $SEEDS; do
      for level in ${LEVELS:-alpha0.1 alpha0.5 iid alpha0.3}; do run "$level" "configs/spark.py:$level" "$s"; done
    done ;;
  spark_ablation)
    # Distillation only / momentum only equal no distillation / SPARK through the 10 hard-label warm-up rounds:
    # they start from those runs' kept round-10 checkpoints (a third less compute).
    rows=" ${ROWS:-none both distill momentum} "
    for s in $SEEDS; do
      [[ $rows == *" none "* ]] && run abl_none configs/spark.py:iid,abl_none "$s" "--config.checkpoint_keep=(10,)"
      [[ $rows == *" both "* ]] && run abl_both configs/spark.py:iid,abl_both "$s" "--config.checkpoint_keep=(10,)"
      [[ $rows == *" distill "* ]] && branch abl_distill configs/spark.py:iid,abl_distill "$s" abl_none
      [[ $rows == *" momentum "* ]] && branch abl_momentum configs/spark.py:iid,abl_momentum "$s" abl_both
    done ;;
  spark_ntk_dfl)
    for s in $SEEDS; do
      for level in ${LEVELS:-alpha0.1 alpha0.3 alpha0.5}; do run "$level" "configs/spark.py:$level,abl_none" "$s"; done
    done ;;
  spark_comm)
    for s in $SEEDS; do
      for v in ${VARIANTS:-proj500 proj750 full_stack}; do run "$v" "configs/spark.py:alpha0.1,$v" "$s"; done
    done ;;
  *) echo "unknown suite '$SUITE'; the suites are ntk_dfl, ntk_dfl_authors, baselines, ntk_fl, ntk_fl_busiest, spark, spark_ablation, spark_ntk_dfl, spark_comm" >&2; exit 2 ;;
esac
finished=()
for dir in "$OUT"/*_s*/; do [ -f "$dir/summary.json" ] && finished+=("${dir%/}"); done
ARCHIVE=${ARCHIVE-docs/runs/$(basename "$OUT")}
[ ${#finished[@]} -gt 0 ] && $PYTHON experiments/summarize_runs.py "${finished[@]}" --plot "$OUT/summary.png" \
  ${ARCHIVE:+--archive "$ARCHIVE"}
