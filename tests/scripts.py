"""Import a script from ``experiments/`` or ``benchmarks/`` by file path (neither folder is a package)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

REPO = pathlib.Path(__file__).resolve().parent.parent
EXPERIMENTS = REPO / "experiments"
BENCHMARKS = REPO / "benchmarks"


def _load(path: pathlib.Path) -> types.ModuleType:
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_experiment(name: str) -> types.ModuleType:
  """``experiments/<name>.py`` as a fresh module object."""
  return _load(EXPERIMENTS / f"{name}.py")


def load_benchmark(name: str) -> types.ModuleType:
  """``benchmarks/<name>.py`` as a fresh module object."""
  # Its folder on sys.path, as when it runs as a script: a benchmark imports its sibling _timing.py.
  if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))
  return _load(BENCHMARKS / f"{name}.py")
