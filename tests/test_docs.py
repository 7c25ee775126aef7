"""The API reference's build (scripts/build_docs.py): every docstring cross-reference resolves."""

from __future__ import annotations

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def _build_docs():
  spec = importlib.util.spec_from_file_location("build_docs", REPO / "scripts" / "build_docs.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_docstring_cross_reference_resolves():
  assert _build_docs().broken_references() == []


def test_a_broken_cross_reference_is_found():
  import ntk_fl.rundir  # pylint: disable=g-import-not-at-top

  build_docs = _build_docs()

  def resolve(target):
    return build_docs._resolve(target, [ntk_fl.rundir])  # pylint: disable=protected-access

  assert resolve("ntk_fl.rundir.read_metrics") and resolve("ntk_fl.settings.RunSettings.algorithm")
  assert resolve("read_metrics")  # a bare name, in the docstring's module
  assert resolve("ntk_fl.data")  # a module
  assert not resolve("ntk_fl.rundir.read_metric")  # a typo
  assert not resolve("ntk_fl.no_such_module.x") and not resolve("no_such_name")
  doc = "See :func:`ntk_fl.rundir.nope` and :class:`~ntk_fl.settings.RunSettings`."
  assert [m.group(2) for m in build_docs.ROLE.finditer(doc)] == [
    "ntk_fl.rundir.nope",
    "ntk_fl.settings.RunSettings",
  ]


def test_the_reference_covers_every_public_module():
  modules = _build_docs().public_modules()
  assert {
    "ntk_fl",
    "ntk_fl.cli",
    "ntk_fl.config_docs",
    "ntk_fl.algorithms.ntk_dfl",
    "ntk_fl.data.sources",
  } <= set(modules)
  assert not [m for m in modules if any(part.startswith("_") for part in m.split("."))]
  assert not [m for m in modules if m.startswith("ntk_fl.configs.")]
