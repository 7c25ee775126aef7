"""Paired significance tests over seeds (SPARK Table 3).

SPARK compares itself with NTK-DFL by a two-sided paired t-test over three
shared seeds: for each seed ``s`` the difference ``Δ_s = acc_method(s) −
acc_baseline(s)`` of the two runs' aggregated test accuracy at the same round,
then the mean gain, its ``t``-based confidence interval, the ``p``-value and the
paired effect size ``d_z = mean(Δ) / sd(Δ)`` (sample standard deviation; the
paper: "not comparable to between-group Cohen's d"). The test itself is
``scipy.stats.ttest_rel``; this module adds the effect size, the interval at a
chosen level and the degenerate case of identical differences, and is read by
:mod:`ntk_fl.compare`, :mod:`ntk_fl.reproduce` and ``experiments/paired_test.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple
from collections.abc import Sequence

import numpy as np
from scipy import stats as scipy_stats


class PairedTest(NamedTuple):
  """A two-sided paired t-test of ``treatment − control`` over ``n`` matched pairs."""

  n: int
  gain: float  # mean(Δ), in the inputs' unit
  ci_low: float  # the ``confidence`` interval of mean(Δ)
  ci_high: float
  t: float  # mean(Δ) / (sd(Δ) / sqrt(n)); ±inf when every Δ is the same non-zero value
  p: float  # two-sided, n − 1 degrees of freedom
  d_z: float  # mean(Δ) / sd(Δ)


def paired_t_test(
  treatment: Sequence[float], control: Sequence[float], *, confidence: float = 0.95
) -> PairedTest:
  """Paired t-test of ``treatment[i] − control[i]``; pairs are matched by position (e.g. by seed).

  Args:
    treatment: ``[n]`` per-pair values of the method (e.g. SPARK's round-30 accuracy per seed).
    control: ``[n]`` the baseline's values for the same pairs.
    confidence: level of the interval, in (0, 1).

  Raises:
    ValueError: on unequal lengths, fewer than two pairs, non-finite values or a
      ``confidence`` outside (0, 1) -- none of them has a t-test.
  """
  treatment = np.asarray(treatment, dtype=np.float64)
  control = np.asarray(control, dtype=np.float64)
  if treatment.ndim != 1 or treatment.shape != control.shape:
    raise ValueError(
      f"paired_t_test needs two 1-D sequences of equal length; got shapes {treatment.shape} "
      f"and {control.shape}"
    )
  n = treatment.shape[0]
  if n < 2:
    raise ValueError(
      f"paired_t_test needs at least 2 pairs (the spread of the differences); got {n}"
    )
  if not (np.all(np.isfinite(treatment)) and np.all(np.isfinite(control))):
    raise ValueError(
      f"paired_t_test got non-finite values: treatment {treatment.tolist()}, "
      f"control {control.tolist()}"
    )
  if not 0 < confidence < 1:
    raise ValueError(f"confidence must be in (0, 1); got {confidence}")
  diff = treatment - control
  gain = float(diff.mean())
  sd = float(diff.std(ddof=1))
  if sd == 0:  # identical differences: no spread, the interval is the point itself
    t = 0.0 if gain == 0 else math.copysign(math.inf, gain)
    p = 1.0 if gain == 0 else 0.0
    return PairedTest(n, gain, gain, gain, t, p, t)
  result = scipy_stats.ttest_rel(treatment, control)  # two-sided, n − 1 degrees of freedom
  interval = result.confidence_interval(confidence_level=confidence)
  return PairedTest(
    n,
    gain,
    float(interval.low),
    float(interval.high),
    float(result.statistic),
    float(result.pvalue),
    gain / sd,
  )
