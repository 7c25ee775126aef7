"""The package's layering: what importing a module loads, and which modules may import which."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import ntk_fl

_PACKAGE = pathlib.Path(ntk_fl.__file__).parent


def _loaded_after(statement: str) -> set[str]:
  code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return set(out.stdout.split())


def _imported_modules(relative_path: str) -> set[str]:
  """Every ``ntk_fl`` module a source file imports, at its top or inside a function."""
  tree = ast.parse((_PACKAGE / relative_path).read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return {n for n in names if n.startswith("ntk_fl")}


def test_the_kernels_load_neither_flax_nor_the_device_code():
  loaded = _loaded_after("import ntk_fl.ntk")
  assert "ntk_fl.ntk" in loaded and "ntk_fl._src.kernels" in loaded
  for heavy in ("flax", "ntk_fl.models", "ntk_fl.parallel", "ntk_fl.distributed"):
    assert heavy not in loaded, heavy


def test_dense_stack_is_one_class_wherever_it_is_named():
  from ntk_fl import models, ntk, projection  # pylint: disable=import-outside-toplevel
  from ntk_fl._src.dense_stack import DenseStack  # pylint: disable=import-outside-toplevel
  assert models.DenseStack is DenseStack and ntk.DenseStack is DenseStack
  assert projection.DenseStack is DenseStack


def test_the_implementation_layer_does_not_import_the_public_kernel_module():
  # The cycle ntk -> neural_tangents_api -> ntk is gone: the private layer imports only downwards.
  public = {"ntk_fl.ntk", "ntk_fl.evolve", "ntk_fl.models"}
  for module in ("neural_tangents_api", "kernels", "options", "dense_stack"):
    assert not _imported_modules(f"_src/{module}.py") & public, module


def test_reading_a_run_directory_does_not_import_the_schema():
  # The cycle config -> rundir -> schema -> config is gone.
  assert not _imported_modules("rundir.py") & {"ntk_fl.schema", "ntk_fl.config"}
  assert "ntk_fl.schema" not in _loaded_after("import ntk_fl.rundir")
