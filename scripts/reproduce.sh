#!/bin/bash
# The papers' acceptance runs by their former suite names: a thin wrapper over `ntk-fl reproduce`.
#
#   bash scripts/reproduce.sh SUITE|EXPERIMENT [OUT] [SEEDS]
#
# EXPERIMENT is any name of `ntk-fl reproduce --list` (e.g. ntk_dfl:fig9). The former suites map to experiments
# of the registry (ntk_fl/reproduce/experiments.py), restricted as before by METHODS / LEVELS / ROWS / VARIANTS:
#   ntk_dfl          ntk_dfl:fig2            ntk_dfl_authors  ntk_dfl:fig2_authors
#   baselines        ntk_dfl:fig2_baselines  (METHODS="dfedavg dpsgd", LEVELS="iid alpha0.5")
#   ntk_fl           ntk_fl:table1           ntk_fl_busiest   ntk_dfl:appC1
#   spark            SPARK's runs of spark:table1 / spark:table2 (LEVELS from alpha0.1 alpha0.5 iid alpha0.3)
#   spark_ablation   spark:table4 (ROWS from none both distill momentum)
#   spark_ntk_dfl    the NTK-DFL side of spark:table3 (LEVELS from alpha0.1 alpha0.3 alpha0.5)
#   spark_comm       spark:fig9's caps and spark:fig11's full stack (VARIANTS from proj500 proj750 full_stack)
#
# OUT defaults to runs/<suite>; SEEDS to the experiment's (three seeds for these suites). The queue skips
# finished runs, resumes interrupted ones and moves aside runs killed before their first checkpoint (see
# `ntk-fl reproduce --help`). PYTHON (default .venv/bin/python) runs each run and may carry a prefix, e.g.
# PYTHON="taskset -c 1 .venv/bin/python" with XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
# intra_op_parallelism_threads=1" runs a queue on one core, so that two queues share a 2-core machine
# (benchmarks/RESULTS.md). EXTRA holds flags added to every run (EXTRA="--config.chunk_size=0" on a GPU).
# The rendered runs' per-round scalars are archived to ARCHIVE (default docs/runs/<OUT's name>; ARCHIVE= skips
# it): runs/ does not outlive the machine, the archive is committed with the results it backs. DRY_RUN=1 prints
# what the queue would do.
set -u
cd "$(dirname "$0")/.."
SUITE=${1:?usage: bash scripts/reproduce.sh SUITE|EXPERIMENT [OUT] [SEEDS]; ntk-fl reproduce --list shows the experiments}
OUT=${2:-runs/${SUITE//:/_}}
SEEDS=${3:-}
PYTHON=${PYTHON:-.venv/bin/python}
ARCHIVE=${ARCHIVE-docs/runs/$(basename "$OUT")}
status=0

rep() {  # experiment [variant patterns...]
  local experiment=$1; shift
  local args=(-m ntk_fl reproduce "$experiment" --out "$OUT" --python "$PYTHON" "--extra=${EXTRA:-}")
  [ -n "$SEEDS" ] && args+=(--seeds $SEEDS)
  [ $# -gt 0 ] && args+=(--variants "$@")
  [ -n "$ARCHIVE" ] && args+=(--archive "$ARCHIVE")
  [ -n "${DRY_RUN:-}" ] && args+=(--dry_run)
  # shellcheck disable=SC2086
  ${PYTHON} "${args[@]}" || status=$?
}

case "$SUITE" in
  ntk_dfl) rep ntk_dfl:fig2 ;;
  ntk_dfl_authors) rep ntk_dfl:fig2_authors ;;
  ntk_fl) rep ntk_fl:table1 ;;
  ntk_fl_busiest) rep ntk_dfl:appC1 ;;
  baselines)
    patterns=()
    for m in ${METHODS:-dfedavg dfedavgm dfedsam dispfl dpsgd}; do
      for level in ${LEVELS:-alpha0.1 alpha0.5 iid}; do patterns+=("${m}_$level"); done
    done
    rep ntk_dfl:fig2_baselines "${patterns[@]}" ;;
  spark)
    t1=(); t2=()
    for level in ${LEVELS:-alpha0.1 alpha0.5 iid alpha0.3}; do
      if [ "$level" = alpha0.3 ]; then t2+=(spark_alpha0.3); else t1+=("spark_$level"); fi
    done
    [ ${#t1[@]} -gt 0 ] && rep spark:table1 "${t1[@]}"
    [ ${#t2[@]} -gt 0 ] && rep spark:table2 "${t2[@]}" ;;
  spark_ablation)
    patterns=()
    for row in ${ROWS:-none both distill momentum}; do
      case "$row" in
        both) patterns+=(spark_iid) ;;
        none|distill|momentum) patterns+=("spark_abl_${row}_iid") ;;
        *) echo "unknown row '$row' in ROWS (none, both, distill, momentum)" >&2; exit 2 ;;
      esac
    done
    rep spark:table4 "${patterns[@]}" ;;
  spark_ntk_dfl)
    patterns=()
    for level in ${LEVELS:-alpha0.1 alpha0.3 alpha0.5}; do patterns+=("spark_abl_none_$level"); done
    rep spark:table3 "${patterns[@]}" ;;
  spark_comm)
    caps=(); stack=()
    for v in ${VARIANTS:-proj500 proj750 full_stack}; do
      if [ "$v" = full_stack ]; then stack+=(spark_comm_full_stack); else caps+=("spark_comm_$v"); fi
    done
    [ ${#caps[@]} -gt 0 ] && rep spark:fig9 "${caps[@]}"
    [ ${#stack[@]} -gt 0 ] && rep spark:fig11 "${stack[@]}" ;;
  *:*) rep "$SUITE" ;;
  *) echo "unknown suite '$SUITE'; the suites are ntk_dfl, ntk_dfl_authors, baselines, ntk_fl, ntk_fl_busiest, spark, spark_ablation, spark_ntk_dfl, spark_comm, or an experiment of ntk-fl reproduce --list" >&2; exit 2 ;;
esac
exit $status
