"""Argument checks shared by every module: one rule for what counts as an int, a real, a bool.

Every check raises ``ValueError`` naming the argument (``name``, e.g.
``"config.data.num_clients"`` or ``"degree"``), the allowed values and what it
got, so a bad value fails early with a message that says how to fix it.
Integers are ``numbers.Integral`` (numpy ints included) but never ``bool``;
reals are finite ``numbers.Real`` but never ``bool``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any
from collections.abc import Iterable

__all__ = [
  "is_int",
  "is_real",
  "check_int",
  "check_real",
  "check_bool",
  "check_choice",
  "check_keys",
]


def is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
  """``value`` as an ``int`` in ``[low, high]`` (either bound optional)."""
  if low is not None and high is not None:
    bound = f"an int in [{low}, {high}]"
  elif low is not None or high is not None:
    bound = f"an int >= {low}" if low is not None else f"an int <= {high}"
  else:
    bound = "an int"
  if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
    raise ValueError(f"{name} must be {bound}, got {value!r}")
  return int(value)


def check_real(
  name: str,
  value: Any,
  low: float | None = None,
  high: float | None = None,
  *,
  low_open: bool = False,
  high_open: bool = False,
) -> float:
  """``value`` as a finite ``float`` within the bounds (closed unless ``*_open``)."""
  too_low = (
    low is not None and (value <= low if low_open else value < low) if is_real(value) else False
  )
  too_high = (
    high is not None and (value >= high if high_open else value > high) if is_real(value) else False
  )
  if not is_real(value) or too_low or too_high:
    interval = (
      ("(" if low_open else "[")
      + ("-inf" if low is None else f"{low:g}")
      + ", "
      + ("inf" if high is None else f"{high:g}")
      + (")" if high_open or high is None else "]")
    )
    raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
  return float(value)


def check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
  return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
  choices = tuple(choices)
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")
  return value


def check_keys(name: str, block: Any, keys: Iterable[str], method: str) -> None:
  """A config block holds exactly ``keys`` (a method's own ``config.algorithm`` schema)."""
  keys = tuple(keys)
  missing = [k for k in keys if k not in block]
  unknown = sorted(set(block) - set(keys))
  if missing or unknown:
    raise ValueError(
      f"{name} for method {method!r}: missing {missing}, unknown {unknown}; the keys are {list(keys)}"
    )
