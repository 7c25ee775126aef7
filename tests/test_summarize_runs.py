"""The per-run tables and the archive of ntk_fl.compare (and experiments/summarize_runs.py, its wrapper) on
hand-written workdirs: their numbers are recomputed here from the lines."""

from __future__ import annotations

import json
import os

import subprocess
import sys
import types

import pytest

from ntk_fl import compare, rundir


@pytest.fixture(scope="module")
def summarize():
  return types.SimpleNamespace(
    read_run=rundir.read_run,
    split_label=rundir.split_label,
    table=compare.run_table,
    detail=compare.detail,
    communication_table=compare.communication_table,
    communication_to_target=compare.communication_to_target,
    plot_communication=compare.plot_communication,
    archive=compare.archive,
    seed_table=lambda runs: compare.compare_markdown(compare.group_runs(runs)),
  )


def _write_run(
  root,
  name: str,
  seed: int,
  accuracies: list[float],
  client: list[float],
  selection: dict | None = None,
  bits_per_round: float | None = None,
) -> str:
  workdir = os.path.join(root, name)
  os.makedirs(workdir)
  config = {
    "method": "ntk_dfl",
    "seed": seed,
    "data": {"name": "fashion_mnist", "partition": "dirichlet", "alpha": 0.1},
    "algorithm": {},
  }
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for r, (acc, mean_client) in enumerate(zip(accuracies, client), start=1):
      line = {
        "round": r,
        "step_time": 10.0 * r,
        "eval_time": 1.0,
        "test_acc": acc,
        "client_acc_mean": mean_client,
      }
      if bits_per_round is not None:
        line["bits_cumulative"] = bits_per_round * r
      f.write(json.dumps(line) + "\n")
  if selection is not None:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({"selection": selection}, f)
  return workdir


def test_seed_table_groups_seeds_and_counts_rounds(summarize, tmp_path):
  a = _write_run(tmp_path, "a_s0", 0, [0.70, 0.81, 0.86], [0.6, 0.7, 0.75])
  b = _write_run(tmp_path, "a_s1", 1, [0.70, 0.80, 0.84, 0.851, 0.86], [0.6, 0.7, 0.7, 0.72, 0.73])
  c = _write_run(tmp_path, "a_s2", 2, [0.70, 0.80], [0.6, 0.7])  # never reaches 85 %
  runs = [summarize.read_run(w) for w in (b, a, c)]
  table = summarize.seed_table(runs[:2]).splitlines()
  assert len(table) == 3  # header, rule, one group
  # Seeds 0 and 1 reach 85 % at rounds 3 and 4: mean 3.5, t-interval 12.706 * 0.5 = 6.4; last common round 3.
  assert "| 0, 1 | 3, 5 | 3, 4 | 3.5 ± 6.4 | 3 |" in table[2]
  partial = summarize.seed_table(runs).splitlines()[2]
  assert "| 0, 1, 2 | 3, 5, 2 | 3, 4, — | 2 of 3 reached | 2 |" in partial


def test_detail_reports_gap_step_time_and_selection(summarize, tmp_path):
  best = [0.80, 0.82, 0.83, 0.84, 0.845, 0.85, 0.849]
  selection = {
    "best_to_worst": best,
    "random": [0.7, 0.75, 0.78, 0.79, 0.80, 0.84, 0.849],
    "worst_to_best": [0.6, 0.65, 0.7, 0.72, 0.74, 0.8, 0.849],
  }
  workdir = _write_run(tmp_path, "b_s0", 0, [0.70, 0.80, 0.85], [0.60, 0.72, 0.80], selection)
  text = summarize.detail(summarize.read_run(workdir))
  assert "70.0/60.0 (1), 80.0/72.0 (2), 85.0/80.0 (3)" in text
  assert "10.0 points at the first round, 5.0 at the last" in text
  assert "median step time of the last 2 rounds: 25 s" in text  # rounds 2 and 3: 20 s and 30 s
  assert (
    "best-to-worst 80.0 % with 1 client, 84.5 % with 5, peak 85.0 % with 6, all 7: 84.9 %; "
    "random 80.0 % and worst-to-best 74.0 % with 5"
  ) in text


def test_server_methods_without_client_models_are_tabulated(summarize, tmp_path):
  workdir = _write_run(tmp_path, "c_s0", 0, [0.70, 0.86], [None, None])
  run = summarize.read_run(workdir)
  row = summarize.table([run]).splitlines()[2]
  assert "| 2 | 2 | 2 | 0.8600 | — |" in row  # 80 % and 85 % first at round 2
  assert "| 0 | 2 | 2 | 2.0 | 2 | 86.00 | — | — |" in summarize.seed_table([run])
  assert "test accuracy by round: 70.0 (1), 86.0 (2)" in summarize.detail(run)


def test_mean_client_scored_every_few_rounds_names_its_round(summarize, tmp_path):
  # Clients scored at rounds 2 and 4 only; the runs end at rounds 5 and 4.
  a = _write_run(
    tmp_path, "d_s0", 0, [0.70, 0.80, 0.84, 0.85, 0.86], [None, 0.70, None, 0.76, None]
  )
  b = _write_run(tmp_path, "d_s1", 1, [0.70, 0.80, 0.84, 0.86], [None, 0.72, None, 0.78])
  runs = [summarize.read_run(w) for w in (a, b)]
  rows = summarize.table(runs).splitlines()
  assert "| 0.8600 | 0.7600 (round 4) |" in rows[2]
  assert "| 0.8600 | 0.7800 |" in rows[3]
  # The comparison takes both at round 4, the last round both logged; the clients were scored then.
  assert "| 4 | 85.50 ± 6.35 | 77.00 ± 12.71 | 8.50 ± 6.35 |" in summarize.seed_table(runs)


def test_communication_table_reads_the_volume_at_the_first_crossing(summarize, tmp_path):
  gigabyte = 8e9
  fast = _write_run(
    tmp_path, "fast_s0", 0, [0.70, 0.86, 0.84, 0.87], [0.6] * 4, bits_per_round=3 * gigabyte
  )
  slow = _write_run(tmp_path, "slow_s0", 0, [0.70, 0.80], [0.6] * 2, bits_per_round=0.5 * gigabyte)
  silent = _write_run(tmp_path, "silent_s0", 0, [0.90], [0.9])  # logs no communication
  runs = [summarize.read_run(w) for w in (fast, slow, silent)]
  assert (
    summarize.communication_to_target(runs[0]["lines"], 0.85) == 6 * gigabyte
  )  # round 2, not round 4
  assert summarize.communication_to_target(runs[1]["lines"], 0.85) is None
  assert summarize.communication_to_target(runs[2]["lines"], 0.85) is None
  table = summarize.communication_table(runs).splitlines()
  assert table[2] == "| fast_s0 | 2 | 6.0 | 3.00 | 12.0 |"
  assert table[3] == "| slow_s0 | — | — | 0.50 | 1.0 |"
  assert len(table) == 4  # the silent run has no row
  assert summarize.communication_table(runs[2:]) == ""
  summarize.plot_communication(runs, str(tmp_path / "comm"))
  assert (tmp_path / "comm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (tmp_path / "comm.pdf").read_bytes()[:5] == b"%PDF-"


def test_archive_keeps_every_scalar_and_drops_the_per_client_arrays(summarize, tmp_path):
  selection = {"best_to_worst": [0.8, 0.85], "random": [0.8, 0.84], "worst_to_best": [0.7, 0.84]}
  workdir = _write_run(
    tmp_path / "runs", "e_s0", 0, [0.70, 0.86], [0.6, 0.7], selection, bits_per_round=8e9
  )
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  for line in lines:  # what the runner logs beside the scalars: [M] arrays
    line["clients"] = {"test_acc": [0.5, 0.6, 0.7], "tau": [100, 200, 300]}
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(line) + "\n" for line in lines))
  target = summarize.archive(workdir, str(tmp_path / "archive"))
  assert target == str(tmp_path / "archive" / "e_s0") and not os.path.exists(target + ".partial")
  original, archived = summarize.read_run(workdir), summarize.read_run(target)
  assert archived["config"] == original["config"] and archived["summary"] == original["summary"]
  assert archived["lines"] == [
    {k: v for k, v in line.items() if k != "clients"} for line in original["lines"]
  ]
  assert all("clients" in line for line in original["lines"])
  for render in (summarize.table, summarize.seed_table, summarize.communication_table):
    assert render([archived]) == render([original])
  assert summarize.detail(archived) == summarize.detail(original)
  # Archiving again replaces the copy (a run archived while in progress, then finished).
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write(
      json.dumps({"round": 3, "step_time": 1.0, "test_acc": 0.87, "client_acc_mean": 0.8}) + "\n"
    )
  summarize.archive(workdir, str(tmp_path / "archive"))
  assert [line["round"] for line in summarize.read_run(target)["lines"]] == [1, 2, 3]


def test_a_running_run_with_a_half_written_last_line_is_read_up_to_its_last_round(
  summarize, tmp_path
):
  workdir = _write_run(tmp_path, "h_s0", 0, [0.70, 0.86], [0.6, 0.7])
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write('{"round": 3, "step_time": 30.0, "test_a')  # the runner is writing round 3 right now
  run = summarize.read_run(workdir)
  assert [line["round"] for line in run["lines"]] == [1, 2] and run["summary"] is None
  assert "| 2 | 2 | 0.8600 | 0.7000 |" in summarize.table([run])
  target = summarize.archive(
    workdir, str(tmp_path / "archive")
  )  # the archive holds the two whole rounds
  assert [line["round"] for line in summarize.read_run(target)["lines"]] == [1, 2]
  # A broken line that is not the last one is not a write in progress: it is an error naming the line.
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write(
      "\n" + json.dumps({"round": 4, "step_time": 40.0, "eval_time": 1.0, "test_acc": 0.87}) + "\n"
    )
  with pytest.raises(ValueError, match="line 3 is not valid JSON"):
    summarize.read_run(workdir)


def test_detail_reports_the_consensus_models_when_logged(summarize, tmp_path):
  workdir = _write_run(tmp_path, "f_s0", 0, [0.70, 0.86], [0.6, 0.8])
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  lines[-1].update(consensus_acc_mean=0.845, consensus_acc_min=0.80, consensus_acc_max=0.87)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(line) + "\n" for line in lines))
  text = summarize.detail(summarize.read_run(workdir))
  assert (
    "consensus models (one averaging step later) at round 2: mean 84.5 % (80.0–87.0), 1.5 points under"
    in text
  )
  assert "consensus" not in summarize.detail(
    summarize.read_run(_write_run(tmp_path, "g_s0", 0, [0.7], [0.6]))
  )


def test_the_wrapper_prints_the_tables_and_archives(tmp_path):
  workdir = _write_run(tmp_path / "runs", "w_s0", 0, [0.70, 0.86], [0.6, 0.7], bits_per_round=8e9)
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  done = subprocess.run(
    [
      sys.executable,
      "experiments/summarize_runs.py",
      workdir,
      "--archive",
      str(tmp_path / "archive"),
      "--plot",
      str(tmp_path / "curves.png"),
      "--detail",
    ],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert done.returncode == 0, done.stderr
  assert "| w_s0 | 2 | 2.0 | 1.00 | 2.0 |" in done.stdout  # the communication table
  assert "aggregated − mean client: 10.0 points" in done.stdout
  assert (
    rundir.read_run(str(tmp_path / "archive" / "w_s0"))["lines"]
    == rundir.read_run(workdir)["lines"]
  )
  assert (tmp_path / "curves.png").exists() and (tmp_path / "curves.pdf").exists()


@pytest.mark.parametrize(
  "data,label",
  [
    ({"partition": "iid", "alpha": 0.1}, "IID"),
    ({"partition": "dirichlet_fixed_size", "alpha": 0.5}, "α=0.5"),
    ({"partition": "shards", "alpha": 0.1, "classes_per_client": 2}, "2 labels/client"),
    ({"partition": "contiguous", "alpha": 0.1}, "contiguous"),
    (
      {"partition": "index_map", "alpha": 0.1, "partition_file": "fmnist_alpha0.1_3"},
      "authors α=0.1 d3",
    ),
    ({"partition": "index_map", "alpha": 0.1, "partition_file": "fmnist_iid_0"}, "authors IID d0"),
    ({"partition": "index_map", "alpha": 0.1, "partition_file": "/maps/mine.npz"}, "mine.npz"),
  ],
)
def test_split_labels_name_the_partition(summarize, data, label):
  assert summarize.split_label({"data": data}) == label
