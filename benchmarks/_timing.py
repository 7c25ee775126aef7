"""The benchmarks' one timing loop: a first call, untimed warm calls, then timed repeats.

  from _timing import time_calls  # a benchmark's own folder is on sys.path when it runs

  timing = time_calls(jax.jit(fn), x, y, repeats=5)
  timing.first_s   # the first call: compilation + one run, for a function not compiled yet
  timing.best      # the fastest timed repeat (least disturbed by other jobs)
  timing.median    # the typical one

Every call blocks until its outputs are ready (``jax.block_until_ready``), so a time is the whole
computation's, not its dispatch. For a program compiled beforehand (``jax.jit(fn).lower(...).compile()``,
to read its cost or memory analysis) the first call is its first, cold run, and the timed repeats are
the steady state as before.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from time import perf_counter
from typing import Any, NamedTuple

__all__ = ["Timing", "time_calls"]


class Timing(NamedTuple):
  """Wall times in seconds of the calls of :func:`time_calls`.

  ``times`` holds the ``repeats`` timed calls in order; ``best`` and ``median`` are theirs (the first
  call's time when ``repeats`` is 0). ``output``: the first call's result.
  """

  first_s: float
  times: tuple[float, ...]
  best: float
  median: float
  output: Any


def time_calls(fn: Callable, *args, repeats: int, warmup: int = 0) -> Timing:
  """Calls ``fn(*args)`` once (timed: ``first_s``), ``warmup`` more times untimed, then ``repeats`` times,
  each timed; every call waits for its outputs (``jax.block_until_ready``).

  Args:
    fn: the function (``jax.jit``-wrapped, or a compiled program).
    *args: its arguments, the same for every call.
    repeats: timed calls after the first and the warm ones (``>= 0``).
    warmup: untimed calls between the first and the timed ones.
  """
  import jax  # pylint: disable=import-outside-toplevel

  if repeats < 0 or warmup < 0:
    raise ValueError(f"repeats and warmup must be >= 0, got {repeats} and {warmup}")

  def timed_call():
    start = perf_counter()
    out = jax.block_until_ready(fn(*args))
    return perf_counter() - start, out

  first_s, output = timed_call()
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = tuple(timed_call()[0] for _ in range(repeats))
  measured = times or (first_s,)
  return Timing(first_s, times, min(measured), statistics.median(measured), output)
