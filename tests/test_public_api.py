"""The flat public API of ``ntk_fl`` (like optax's): every exported name resolves, lazily."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ntk_fl


def test_every_exported_name_is_its_module_object():
  for name in ntk_fl.__all__:
    if name == "__version__":
      continue
    module, attr = ntk_fl._EXPORTS[name]  # pylint: disable=protected-access
    assert getattr(ntk_fl, name) is getattr(importlib.import_module(module), attr), name
  assert ntk_fl.available_methods() == ntk_fl.algorithms.available()
  assert "ntk_dfl" in ntk_fl.available_methods() and ntk_fl.load_dataset is ntk_fl.data.load
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    ntk_fl.no_such_name  # noqa: B018  # pylint: disable=pointless-statement


def test_importing_the_package_loads_no_jax():
  # Names are resolved on first use, so `import ntk_fl` (e.g. for --help of the console script) stays cheap.
  code = "import sys, ntk_fl; print('jax' in sys.modules, ntk_fl.__version__)"
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True
  ).stdout.split()
  assert out == ["False", ntk_fl.__version__]
