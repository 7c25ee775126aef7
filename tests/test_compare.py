"""ntk_fl.compare (``ntk-fl compare``) on hand-written runs; statistics recomputed here with numpy
and scipy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from ntk_fl import compare, rundir
from ntk_fl.config import load_config


def stored_config(seed: int = 0, **overrides) -> dict:
  """A whole config as a run stores it (``config.json``): the packaged smoke config with dotted
  overrides."""
  config = load_config("ntk_dfl", "smoke")
  config.seed = seed
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  return json.loads(json.dumps(rundir.jsonable(config)))


def write_run(root, name: str, config: dict, accuracies, client=None) -> str:
  workdir = os.path.join(root, name)
  os.makedirs(workdir)
  with open(os.path.join(workdir, rundir.CONFIG_FILE), "w") as f:
    json.dump(config, f)
  client = client if client is not None else [None] * len(accuracies)
  with open(os.path.join(workdir, rundir.METRICS_FILE), "w") as f:
    for r, (acc, mean_client) in enumerate(zip(accuracies, client), start=1):
      f.write(
        json.dumps(
          {
            "round": r,
            "step_time": 2.0,
            "eval_time": 0.5,
            "test_acc": acc,
            "client_acc_mean": mean_client,
          }
        )
        + "\n"
      )
  return workdir


@pytest.fixture
def lr_runs(tmp_path):
  """The reported mix-up: an lr = 0.03 run beside two lr = 0.01 runs (seeds 0 and 1)."""
  return [
    write_run(tmp_path, "smoke", stored_config(0), [0.70, 0.80, 0.86], [0.60, 0.70, 0.75]),
    write_run(
      tmp_path,
      "smoke_lr03",
      stored_config(0, **{"algorithm.lr": 0.03}),
      [0.75, 0.84, 0.88],
      [0.65, 0.72, 0.80],
    ),
    write_run(tmp_path, "smoke_s1", stored_config(1), [0.72, 0.83, 0.85], [0.61, 0.74, 0.77]),
  ]


def test_runs_differing_in_lr_are_two_groups_labelled_by_the_lr(lr_runs):
  groups = compare.group_runs([rundir.read_run(w) for w in lr_runs])
  assert [g.label for g in groups] == ["algorithm.lr=0.01", "algorithm.lr=0.03"]
  assert [g.seeds for g in groups] == [[0, 1], [0]]
  assert [os.path.basename(run["workdir"]) for run in groups[0].runs] == ["smoke", "smoke_s1"]


def test_only_the_seed_and_execution_fields_are_ignored(tmp_path):
  a = write_run(tmp_path, "a", stored_config(0), [0.8])
  b = write_run(
    tmp_path, "b", stored_config(1, chunk_size=4, checkpoint_every=3), [0.8]
  )  # same setting
  c = write_run(tmp_path, "c", stored_config(2, **{"eval.stop_at": 0.85}), [0.8])  # another setting
  d = write_run(
    tmp_path, "d", stored_config(2, **{"topology.name": "ring", "data.alpha": 0.5}), [0.8]
  )
  groups = compare.group_runs([rundir.read_run(w) for w in (a, b, c, d)])
  assert [g.seeds for g in groups] == [[0, 1], [2], [2]]
  assert groups[1].label == "data.alpha=0.1, eval.stop_at=0.85, topology.name=regular"
  assert groups[2].label == "data.alpha=0.5, eval.stop_at=0, topology.name=ring"


def test_two_runs_of_one_setting_and_seed_are_refused(tmp_path):
  a = write_run(tmp_path, "a", stored_config(0), [0.8])
  b = write_run(tmp_path, "b", stored_config(0), [0.9])
  with pytest.raises(ValueError, match="same setting with the same seed 0"):
    compare.group_runs([rundir.read_run(w) for w in (a, b)])


def test_methods_are_labelled_by_method_not_by_their_hyperparameter_blocks(tmp_path):
  spark = load_config("spark", "smoke")
  spark_json = json.loads(json.dumps(rundir.jsonable(spark)))
  a = write_run(tmp_path, "a", stored_config(0), [0.8])
  b = write_run(tmp_path, "b", spark_json, [0.8])
  labels = [g.label for g in compare.group_runs([rundir.read_run(w) for w in (a, b)])]
  assert labels[0].startswith("method=ntk_dfl") and labels[1].startswith("method=spark")
  assert not any("algorithm." in label for label in labels)


def test_interval_rounds_and_paired_test_match_numpy_and_scipy(tmp_path):
  acc = {0: [0.70, 0.84, 0.86, 0.87], 1: [0.71, 0.85, 0.86, 0.875], 2: [0.69, 0.82, 0.84, 0.851]}
  other = {0: [0.60, 0.80, 0.83, 0.84], 1: [0.62, 0.81, 0.83, 0.851], 2: [0.61, 0.79, 0.82, 0.842]}
  dirs = [
    write_run(tmp_path, f"a{s}", stored_config(s), acc[s], [a - 0.1 for a in acc[s]]) for s in acc
  ]
  dirs += [
    write_run(tmp_path, f"b{s}", stored_config(s, **{"algorithm.lr": 0.02}), other[s])
    for s in other
  ]
  groups = compare.group_runs([rundir.read_run(w) for w in dirs])
  summary = compare.summarize(groups[0], 0.85)
  assert summary.reached == [3, 2, 4] and summary.round == 4
  final = np.array([acc[s][-1] for s in (0, 1, 2)]) * 100
  half = scipy_stats.t.ppf(0.975, 2) * final.std(ddof=1) / np.sqrt(3)
  mean, got_half = compare.mean_ci(final)
  np.testing.assert_allclose([mean, got_half], [final.mean(), half], rtol=1e-12)
  low, high = scipy_stats.t.interval(0.95, 2, loc=final.mean(), scale=scipy_stats.sem(final))
  np.testing.assert_allclose([mean - got_half, mean + got_half], [low, high], rtol=1e-12)
  assert (
    compare.rounds_cell(summary)
    == f"{3.0:.1f} ± {scipy_stats.t.ppf(0.975, 2) * 1.0 / np.sqrt(3):.1f}"
  )
  np.testing.assert_allclose(summary.gap, [10.0] * 3, atol=1e-9)
  [test] = compare.paired_tests(groups)
  assert test["seeds"] == [0, 1, 2] and test["round"] == 4
  theirs = np.array([other[s][-1] for s in (0, 1, 2)]) * 100
  reference = scipy_stats.ttest_rel(final, theirs)
  np.testing.assert_allclose(
    [test["test"].t, test["test"].p], [reference.statistic, reference.pvalue], rtol=1e-10
  )
  np.testing.assert_allclose(test["test"].gain, (final - theirs).mean(), rtol=1e-12)
  text = compare.compare_markdown(groups)
  assert f"| {reference.pvalue:.2g} |" in text and "| 3, 2, 4 |" in text
  assert "1 of 3 reached" in compare.compare_markdown(groups[1:])  # seed 1 only crosses 85 %


def test_one_seed_has_no_interval_and_no_test(lr_runs):
  groups = compare.group_runs([rundir.read_run(w) for w in lr_runs])
  assert np.isnan(compare.mean_ci([0.5])[1])
  assert compare.paired_tests(groups) == []  # seeds shared: only seed 0
  row = compare.compare_markdown(groups).splitlines()[3]
  assert row.startswith("| algorithm.lr=0.03 | 0 | 3 | 3 | 3.0 | 3 | 88.00 | 80.00 | 8.00 |")


def test_curves_are_the_per_round_means_with_intervals_and_integer_ticks(lr_runs, tmp_path):
  runs = [rundir.read_run(w) for w in lr_runs]
  groups = compare.group_runs(runs)
  drawn = compare.plot_curves(groups, str(tmp_path / "out" / "curves"))
  agg = drawn["curves"]["algorithm.lr=0.01"]["test_acc"]
  np.testing.assert_array_equal(agg["rounds"], [1, 2, 3])
  np.testing.assert_allclose(agg["mean"], [0.71, 0.815, 0.855])
  # Two seeds: sd = |a − b| / √2, sem = |a − b| / 2.
  np.testing.assert_allclose(
    agg["half"], scipy_stats.t.ppf(0.975, 1) * np.array([0.02, 0.03, 0.01]) / 2, rtol=1e-9
  )
  client = drawn["curves"]["algorithm.lr=0.01"]["client_acc_mean"]
  np.testing.assert_allclose(client["mean"], [0.605, 0.72, 0.76])
  assert np.isnan(drawn["curves"]["algorithm.lr=0.03"]["test_acc"]["half"]).all()
  assert drawn["xticks"] and all(
    t.is_integer() for t in drawn["xticks"]
  )  # 3 rounds: no 1.5, 2.5 ticks
  assert (tmp_path / "out" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (tmp_path / "out" / "curves.pdf").read_bytes()[:5] == b"%PDF-"


def test_the_accuracy_band_stays_within_0_and_100_percent(tmp_path):
  # Three seeds far apart: the 95 % t-interval (t = 4.30 with two degrees of freedom) reaches
  # below 0 in round 1 and above 1 in round 2; the drawn band stops at the bounds.
  seeds = ([0.05, 0.97], [0.55, 0.99], [0.30, 0.50])
  runs = [write_run(tmp_path, f"s{s}", stored_config(s), acc) for s, acc in enumerate(seeds)]
  groups = compare.group_runs([rundir.read_run(w) for w in runs])
  drawn = compare.plot_curves(groups, str(tmp_path / "curves"))
  agg = drawn["curves"][groups[0].label]["test_acc"]
  values = np.array(seeds).T
  half = scipy_stats.t.ppf(0.975, 2) * values.std(axis=1, ddof=1) / np.sqrt(3)
  mean = values.mean(axis=1)
  assert mean[0] - half[0] < 0 and mean[1] + half[1] > 1  # the unclipped interval leaves [0, 1]
  low, high = agg["band"]
  np.testing.assert_allclose(low, [0.0, mean[1] - half[1]], rtol=1e-9)
  np.testing.assert_allclose(high, [mean[0] + half[0], 1.0], rtol=1e-9)


def test_a_round_not_logged_by_all_runs_is_refused(tmp_path):
  a = [write_run(tmp_path, f"a{s}", stored_config(s), [0.8, 0.85]) for s in (0, 1)]
  b = [
    write_run(tmp_path, f"b{s}", stored_config(s, **{"algorithm.lr": 0.02}), [0.8]) for s in (0, 1)
  ]
  groups = compare.group_runs([rundir.read_run(w) for w in a + b])
  assert compare.paired_tests(groups)[0]["round"] == 1
  with pytest.raises(ValueError, match="round 2 is not logged"):
    compare.paired_tests(groups, 2)


def test_command_line(lr_runs, tmp_path):
  out = tmp_path / "cmp"
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  done = subprocess.run(
    [sys.executable, "-m", "ntk_fl", "compare", *lr_runs, "--out", str(out)],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert done.returncode == 0, done.stderr
  assert "| algorithm.lr=0.01 | 0, 1 |" in done.stdout
  assert {p.name for p in out.iterdir()} == {"compare.md", "curves.png", "curves.pdf"}
  bad = subprocess.run(
    [sys.executable, "-m", "ntk_fl", "compare", lr_runs[0], "--target", "85"],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert bad.returncode == 2 and "--target must be an accuracy in (0, 1]; got 85.0" in bad.stderr
