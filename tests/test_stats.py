"""ntk_fl.stats.paired_t_test and experiments/paired_test.py (SPARK Table 3) against closed forms and scipy."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from scipy import stats as scipy_stats

from ntk_fl import rundir, stats
from scripts import load_experiment


def test_three_pairs_match_the_student_t_closed_form_with_two_degrees_of_freedom():
  # Δ = [2, 3, 4]: mean 3, sd 1, t = 3·√3. With 2 degrees of freedom the t distribution has closed forms:
  # CDF(t) = 1/2 + t / (2·sqrt(2 + t²)) and quantile(q) = (2q − 1) / sqrt(2q(1 − q)).
  result = stats.paired_t_test([3.0, 5.0, 7.0], [1.0, 2.0, 3.0])
  t = 3 * math.sqrt(3)
  quantile = 0.95 / math.sqrt(2 * 0.975 * 0.025)
  assert result.n == 3
  assert result.gain == pytest.approx(3.0, abs=1e-12)
  assert result.t == pytest.approx(t, rel=1e-12)
  assert result.d_z == pytest.approx(3.0, rel=1e-12)
  assert result.p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
  assert result.ci_low == pytest.approx(3 - quantile / math.sqrt(3), rel=1e-9)
  assert result.ci_high == pytest.approx(3 + quantile / math.sqrt(3), rel=1e-9)


@pytest.mark.parametrize("n", [2, 5, 9])
def test_random_pairs_match_scipy_ttest_rel(n):
  rng = np.random.default_rng(n)
  control = rng.normal(85.0, 0.3, n)
  treatment = control + rng.normal(1.0, 0.4, n)
  ours = stats.paired_t_test(treatment, control, confidence=0.9)
  reference = scipy_stats.ttest_rel(treatment, control)
  interval = reference.confidence_interval(0.9)
  np.testing.assert_allclose([ours.t, ours.p], [reference.statistic, reference.pvalue], rtol=1e-10)
  np.testing.assert_allclose([ours.ci_low, ours.ci_high], [interval.low, interval.high], rtol=1e-10)
  diff = treatment - control
  assert ours.d_z == pytest.approx(diff.mean() / diff.std(ddof=1), rel=1e-12)


@pytest.mark.parametrize(
  "gain, d_z, p, ci",
  [
    (1.35, 7.08, 0.0066, (0.88, 1.82)),  # SPARK Table 3, IID (spark.md §3.4 recomputation)
    (1.36, 27.09, 0.00045, (1.24, 1.48)),  # α = 0.1
    (1.06, 16.44, 0.0012, (0.90, 1.22)),  # α = 0.3
    (0.78, 7.72, 0.0056, (0.53, 1.03)),  # α = 0.5
  ],
)
def test_reproduces_spark_table3_from_its_gain_and_effect_size(gain, d_z, p, ci):
  # Three differences with the table's mean and sample sd gain / d_z (sd of [-1, 0, 1] is 1).
  sd = gain / d_z
  result = stats.paired_t_test(np.array([-1.0, 0.0, 1.0]) * sd + gain, np.zeros(3))
  assert result.d_z == pytest.approx(d_z, rel=1e-9)
  assert result.p == pytest.approx(p, rel=0.05)
  assert (result.ci_low, result.ci_high) == pytest.approx(ci, abs=0.006)


def test_identical_differences_have_no_spread():
  result = stats.paired_t_test([2.0, 3.0], [1.0, 2.0])
  assert (result.gain, result.ci_low, result.ci_high, result.p) == (1.0, 1.0, 1.0, 0.0)
  assert result.t == math.inf and result.d_z == math.inf
  null = stats.paired_t_test([1.0, 2.0], [1.0, 2.0])
  assert (null.gain, null.t, null.p) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize(
  "treatment, control, kwargs, message",
  [
    ([1.0, 2.0], [1.0], {}, "equal length"),
    ([1.0], [0.0], {}, r"at least 2 pairs \(the spread of the differences\); got 1"),
    ([1.0, float("nan")], [0.0, 0.0], {}, "non-finite"),
    ([1.0, 2.0], [0.0, 0.0], {"confidence": 1.0}, r"confidence must be in \(0, 1\); got 1.0"),
  ],
)
def test_bad_input_is_named(treatment, control, kwargs, message):
  with pytest.raises(ValueError, match=message):
    stats.paired_t_test(treatment, control, **kwargs)


# experiments/paired_test.py on hand-written workdirs.


@pytest.fixture(scope="module")
def paired_test():
  return load_experiment("paired_test")


def _write_run(
  root,
  name: str,
  seed: int,
  accuracies: list[float],
  alpha: float | None = 0.1,
  method: str = "spark",
) -> str:
  workdir = os.path.join(root, name)
  os.makedirs(workdir)
  data = {
    "name": "fashion_mnist",
    "num_clients": 300,
    "partition": "iid" if alpha is None else "dirichlet_fixed_size",
    "alpha": alpha or 0.0,
  }
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"method": method, "seed": seed, "data": data, "algorithm": {}}, f)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for r, acc in enumerate(accuracies, start=1):
      f.write(json.dumps({"round": r, "step_time": 1.0, "test_acc": acc}) + "\n")
  return workdir


def _read(dirs):
  return [rundir.read_run(d) for d in dirs]


def test_pairs_by_split_and_seed_and_tests_each_split(paired_test, tmp_path):
  method = [
    _write_run(tmp_path, f"spark_a01_s{s}", s, [0.80, acc])
    for s, acc in ((2, 0.868), (0, 0.867), (1, 0.869))
  ]
  method.append(_write_run(tmp_path, "spark_iid_s0", 0, [0.80, 0.876], alpha=None))
  baseline = [
    _write_run(tmp_path, f"ntk_a01_s{s}", s, [0.79, acc], method="ntk_dfl")
    for s, acc in ((0, 0.854), (1, 0.855), (2, 0.853), (3, 0.850))
  ]  # seed 3 has no partner
  baseline.append(_write_run(tmp_path, "ntk_iid_s0", 0, [0.79, 0.860], alpha=None))
  rows = paired_test.paired_rows(_read(method), _read(baseline), 2)
  assert [row["setting"] for row in rows] == [
    "fashion_mnist, 300 clients, α=0.1",
    "fashion_mnist, 300 clients, IID",
  ]
  dirichlet, iid = rows
  assert dirichlet["seeds"] == [0, 1, 2]
  np.testing.assert_allclose(dirichlet["method"], [86.7, 86.9, 86.8])
  np.testing.assert_allclose(dirichlet["baseline"], [85.4, 85.5, 85.3])
  reference = scipy_stats.ttest_rel([86.7, 86.9, 86.8], [85.4, 85.5, 85.3])
  assert dirichlet["test"].gain == pytest.approx(1.4, abs=1e-9)
  assert dirichlet["test"].p == pytest.approx(reference.pvalue, rel=1e-6)
  assert iid["seeds"] == [0] and iid["test"] is None
  text = paired_test.table(rows, 2).splitlines()
  assert text[2].startswith(
    "| fashion_mnist, 300 clients, α=0.1 | 0, 1, 2 | 86.70, 86.90, 86.80 | "
    "85.40, 85.50, 85.30 | +1.40 | ["
  )
  assert text[3].endswith("| 87.60 | 86.00 | +1.60 | needs ≥ 2 shared seeds | — | — |")


def test_refuses_missing_rounds_duplicates_and_disjoint_sides(paired_test, tmp_path):
  short = _read(
    [_write_run(tmp_path, "short_s0", 0, [0.8]), _write_run(tmp_path, "short_s1", 1, [0.8])]
  )
  full = _read(
    [
      _write_run(tmp_path, "full_s0", 0, [0.8, 0.85]),
      _write_run(tmp_path, "full_s1", 1, [0.8, 0.85]),
    ]
  )
  with pytest.raises(
    ValueError, match=r"short_s0 has no aggregated accuracy for round 2 \(logged through round 1\)"
  ):
    paired_test.paired_rows(short, full, 2)
  twin = _read([_write_run(tmp_path, "twin_s0", 0, [0.8, 0.85])])
  with pytest.raises(
    ValueError, match="two --baseline runs for fashion_mnist, 300 clients, α=0.1, seed 0"
  ):
    paired_test.paired_rows(short, full + twin, 1)
  other = _read([_write_run(tmp_path, "iid_s0", 0, [0.8], alpha=None)])
  with pytest.raises(ValueError, match="no setting and seed is on both sides"):
    paired_test.paired_rows(short, other, 1)
