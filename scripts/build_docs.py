"""Builds the API reference (docs/api/, HTML) from the docstrings with pdoc; any problem fails it.

  python scripts/build_docs.py [--out docs/api] [--check-only]

Two checks, both errors:

* every cross-reference in a docstring (``:mod:`ntk_fl.rundir```, ``:func:`load```,
  ``:class:`ntk_fl.settings.RunSettings```, ...) names something that exists: a
  qualified name is imported, a bare one is looked up in the docstring's module
  (and class);
* pdoc renders every public module without a warning (a module that fails to
  import, an annotation it cannot resolve, ...).

``--check-only`` runs the cross-reference check alone (no pdoc needed, no HTML).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import pathlib
import re
import sys
import warnings

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "ntk_fl"
ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|data|attr|exc|obj|const):`~?([A-Za-z_][\w.]*)`")


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(dotted: str, namespaces) -> bool:
  """Whether ``dotted`` is a module, an attribute chain below one, or below a namespace object."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    if _getattr_chain(obj, parts[cut:]):
      return True
    break
  return any(_getattr_chain(ns, parts) for ns in namespaces)


def _getattr_chain(obj, names) -> bool:
  for name in names:
    if not hasattr(obj, name):
      # A dataclass or NamedTuple field without a default is no class attribute; its annotation is.
      if name in getattr(obj, "__annotations__", {}) or name in getattr(obj, "_fields", ()):
        return True
      return False
    obj = getattr(obj, name)
  return True


def _docstrings(tree: ast.Module):
  """``(docstring, enclosing class names)`` of the module, its classes and functions."""

  def visit(node, classes):
    doc = (
      ast.get_docstring(node, clean=False)
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
      else None
    )
    if doc:
      yield doc, classes
    for child in ast.iter_child_nodes(node):
      inner = classes + (child.name,) if isinstance(child, ast.ClassDef) else classes
      yield from visit(child, inner)

  yield from visit(tree, ())
  # Attribute docstrings (a string right after an assignment), as pdoc shows them.
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if isinstance(body, list):
      for prev, nxt in zip(body, body[1:]):
        value = getattr(nxt, "value", None)
        if (
          isinstance(prev, (ast.Assign, ast.AnnAssign))
          and isinstance(nxt, ast.Expr)
          and isinstance(value, ast.Constant)
          and isinstance(value.value, str)
        ):
          yield nxt.value.value, ()


def broken_references() -> list[str]:
  """``'path:line: :role:`target`'`` for every docstring cross-reference that names nothing."""
  broken = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if "configs" in path.relative_to(PACKAGE).parts and path.name != "__init__.py":
      continue  # config files: executed by load_config, not imported
    source = path.read_text()
    module = importlib.import_module(_module_name(path))
    for doc, classes in _docstrings(ast.parse(source)):
      namespaces = [module]
      obj = module
      for name in classes:
        obj = getattr(obj, name, None)
        if obj is not None:
          namespaces.insert(0, obj)
      for match in ROLE.finditer(doc):
        if not _resolve(match.group(2), namespaces):
          line = source[: source.find(doc)].count("\n") + 1 + doc[: match.start()].count("\n")
          broken.append(f"{path.relative_to(REPO)}:{line}: {match.group(0)}")
  return sorted(set(broken))


def public_modules() -> list[str]:
  """Every module of the package but the private ones (``_name``) and the config files."""
  names = []
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE).parts
    if any(part.startswith("_") and part != "__init__.py" for part in rel):
      continue
    if rel[0] == "configs" and rel[-1] != "__init__.py":
      continue
    names.append(_module_name(path))
  return names


def _namedtuple_constructors_in_their_module(module_names) -> None:
  """Gives each NamedTuple's generated ``__new__`` its class's module.

  ``collections.namedtuple`` makes ``__new__`` in a module of its own
  (``namedtuple_<Name>``), so pdoc resolves the field annotations of the
  signature (strings, under ``from __future__ import annotations``) in an empty
  namespace and warns for every one of them. This process only renders docs.
  """
  for name in module_names:
    module = importlib.import_module(name)
    for value in vars(module).values():
      if isinstance(value, type) and issubclass(value, tuple) and hasattr(value, "_fields"):
        value.__new__.__module__ = value.__module__


def build(out: pathlib.Path) -> list[str]:
  """Renders the public modules into ``out``; returns pdoc's warnings."""
  import pdoc  # pylint: disable=import-outside-toplevel
  import pdoc.render  # pylint: disable=import-outside-toplevel

  import pdoc.extract  # pylint: disable=import-outside-toplevel

  pdoc.render.configure(
    docformat="restructuredtext",
    show_source=False,
    footer_text="ntk_fl API reference, generated by scripts/build_docs.py",
  )
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    specs: list[str] = []
    for name in public_modules():  # a package's spec brings the submodules its __all__ names
      if name not in pdoc.extract.walk_specs(specs or [name]) or not specs:
        specs.append(name)
    _namedtuple_constructors_in_their_module(specs)
    pdoc.pdoc(*specs, output_directory=out)
  return [
    f"{w.category.__name__}: {w.message}"
    for w in caught
    if not issubclass(w.category, DeprecationWarning) or "pdoc" in str(w.filename)
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--out", default=str(REPO / "docs" / "api"), help="output folder (default: docs/api)"
  )
  parser.add_argument(
    "--check-only", action="store_true", help="check cross-references only, render nothing"
  )
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(REPO))
  broken = broken_references()
  for ref in broken:
    print(f"broken cross-reference: {ref}", file=sys.stderr)
  if broken:
    print(f"error: {len(broken)} docstring cross-reference(s) name nothing", file=sys.stderr)
    return 1
  if args.check_only:
    return 0
  problems = build(pathlib.Path(args.out))
  for problem in problems:
    print(f"pdoc: {problem}", file=sys.stderr)
  if problems:
    print(
      f"error: pdoc reported {len(problems)} problem(s); the reference in {args.out} is incomplete",
      file=sys.stderr,
    )
    return 1
  print(f"API reference written to {args.out}/index.html ({len(public_modules())} modules)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
