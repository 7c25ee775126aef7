"""Import a script from ``experiments/`` by file path (the folder is not a package)."""
from __future__ import annotations

import importlib.util
import pathlib
import types

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"


def load_experiment(name: str) -> types.ModuleType:
  """``experiments/<name>.py`` as a fresh module object."""
  spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
