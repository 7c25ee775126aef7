"""``config.method_module``: the user's module a config names for its registrations, imported once.

A leaf (standard library only): the schema imports a config's module, and reading a stored run asks
whether it was imported already (:func:`ntk_fl.rundir.rebuild_config`), neither importing the other.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

__all__ = ["import_method_module", "load_module", "method_module_imported", "module_imported"]


def _file_module_name(path: str) -> str:
  return f"_ntk_fl_user_{abs(hash(os.path.abspath(path))):x}"


def module_imported(spec: str) -> bool:
  """Whether ``spec`` (a dotted name or ``.py`` path) was imported in this process already."""
  return (_file_module_name(spec) if spec.endswith(".py") else spec) in sys.modules


def load_module(spec: str) -> types.ModuleType:
  """Imports ``spec``, a dotted module name or the path of a ``.py`` file (run once per process, like an
  import); raises ``ImportError`` or ``FileNotFoundError``."""
  if not spec.endswith(".py"):
    return importlib.import_module(spec)
  path = os.path.abspath(spec)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such file {path}")
  name = _file_module_name(path)
  if name not in sys.modules:
    file_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = module
    try:
      file_spec.loader.exec_module(module)
    except BaseException:
      del sys.modules[name]
      raise
  return sys.modules[name]


def method_module_imported(spec: str) -> bool:
  """Whether ``spec`` (a dotted name or ``.py`` path) was imported in this process already."""
  return module_imported(spec)


def import_method_module(spec: str) -> None:
  """Imports ``spec`` (a dotted module name, or a path to a ``.py`` file) for its registrations."""
  if not spec:
    return
  try:
    load_module(spec)
  except (ImportError, FileNotFoundError) as e:
    raise ValueError(f"config.method_module = {spec!r} could not be imported: {e}") from e
