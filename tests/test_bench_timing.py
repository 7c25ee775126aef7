"""benchmarks/_timing.py, the benchmarks' one timing loop, on a function whose call times are known."""

from __future__ import annotations

import statistics

import pytest

from scripts import load_benchmark

_timing = load_benchmark("_timing")


class _Clock:
  """A fake ``time.perf_counter``: each call of :meth:`fn` advances it by the next of ``durations``."""

  def __init__(self, durations):
    self.now, self.durations, self.calls = 0.0, list(durations), 0

  def perf_counter(self):
    return self.now

  def fn(self, x):
    self.now += self.durations[self.calls]
    self.calls += 1
    return x + self.calls


@pytest.mark.parametrize("warmup", [0, 2])
def test_first_call_then_warm_ones_then_the_timed_repeats(monkeypatch, warmup):
  durations = [9.0] + [7.0] * warmup + [3.0, 1.0, 2.0, 5.0]
  clock = _Clock(durations)
  monkeypatch.setattr(_timing, "perf_counter", clock.perf_counter)
  timing = _timing.time_calls(clock.fn, 10, repeats=4, warmup=warmup)
  assert clock.calls == 1 + warmup + 4
  timed = durations[1 + warmup :]
  assert timing.first_s == 9.0 and timing.times == tuple(timed)
  assert timing.best == min(timed) and timing.median == statistics.median(timed)
  assert timing.output == 11  # the first call's


def test_no_repeats_reports_the_first_call_and_negative_counts_are_refused(monkeypatch):
  clock = _Clock([4.0])
  monkeypatch.setattr(_timing, "perf_counter", clock.perf_counter)
  timing = _timing.time_calls(clock.fn, 0, repeats=0)
  assert (timing.first_s, timing.times, timing.best, timing.median) == (4.0, (), 4.0, 4.0)
  with pytest.raises(ValueError, match="repeats and warmup must be >= 0, got -1 and 0"):
    _timing.time_calls(clock.fn, 0, repeats=-1)
