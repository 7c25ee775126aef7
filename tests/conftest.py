"""Shared pytest setup: CPU only, float32 by default (tests needing float64 opt in locally).

Compiled XLA executables are cached on disk for the length of one pytest run. Most of the suite's
time is XLA compilation, and many tests compile the same programs again: every
runner test builds a fresh algorithm (new closures, so ``jax.jit``'s in-memory
cache misses) for the same config. The persistent cache is keyed by the
lowered program, the XLA flags, the compile options, the devices and the
jax/jaxlib versions, so a hit returns the executable that compiling would have
produced and the numbers do not change. The directory is made by the first
process that imports this file (the controller of a ``-n 2`` run) and reaches
the xdist workers and the subprocesses tests launch (``experiments/main.py``,
the multi-device check) through the environment, so a program one worker
compiled is a hit in the other. JAX writes an entry without a lock (no
eviction); a reader that meets an entry still being written gets a warning and
compiles, so sharing can cost a compilation, never a wrong executable.

Under pytest-xdist (``-n 2``) the tests are handed out as by ``--dist load``,
except that the tests sharing a fixture of module scope defined in their module
(a finished run, the 4-device subprocess) go to one worker as one unit, the
largest units first (a ``--dist loadscope`` whose scopes are these groups and
single tests; the workers write the groups they collect to a file the
controller's scheduler reads): with plain ``load`` each worker
would compute such a fixture itself, and the 4-device subprocess held the
second worker waiting on its lock. The golden runs, the suite's longest single
tests, are handed out next, so that the two workers finish together on short
tests.
"""

import atexit
import json
import os
import pathlib
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # a cache the caller chose is left to jax
  _cache_dir = tempfile.mkdtemp(prefix="ntk_fl-tests-xla-cache-")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  # The environment reaches the subprocesses tests launch; the config updates reach this process
  # even if a plugin imported jax before this file ran.
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = (
    "0"  # the repeats are many small programs
  )

  import jax

  jax.config.update("jax_compilation_cache_dir", _cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# Where the xdist workers leave the groups they collected for the controller's scheduler (made by the
# controller, the first process to import this file; the workers inherit it).
_GROUPS_ENV = "NTK_FL_TEST_GROUPS_DIR"
if _GROUPS_ENV not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
  os.environ[_GROUPS_ENV] = tempfile.mkdtemp(prefix="ntk_fl-tests-groups-")
  atexit.register(shutil.rmtree, os.environ[_GROUPS_ENV], ignore_errors=True)


def _grouped(config) -> bool:
  """Whether this is a pytest-xdist run that hands out the groups below: ``-n N`` and no ``--dist``."""
  if any(str(arg).startswith(("--dist", "-d")) for arg in config.invocation_params.args):
    return False
  return bool(getattr(config.option, "numprocesses", None)) or hasattr(config, "workerinput")


def _shared_fixture_group(item) -> str | None:
  """``module::fixture`` for the fixtures of module scope defined in the item's own module, or None."""
  info = getattr(item, "_fixtureinfo", None)
  module = item.nodeid.split("::")[0]
  names = sorted(
    name
    for name, defs in (info.name2fixturedefs.items() if info else ())
    if defs and defs[-1].scope == "module" and defs[-1].baseid == module
  )
  return f"{module}::{'+'.join(names)}" if names else None


def pytest_collection_modifyitems(config, items):
  """Slow tests out unless chosen (:func:`_deselect_slow`); on an xdist worker, the order and the groups."""
  _deselect_slow(config, items)
  if not (hasattr(config, "workerinput") and _grouped(config)):
    return
  # Stable: the golden runs first among the single tests, the rest in collection order.
  items.sort(key=lambda item: not item.nodeid.startswith("tests/test_golden.py::"))
  groups = {item.nodeid: group for item in items if (group := _shared_fixture_group(item))}
  out = pathlib.Path(os.environ[_GROUPS_ENV]) / f"{config.workerinput['workerid']}.json"
  tmp = out.with_suffix(".tmp")
  tmp.write_text(json.dumps(groups))
  tmp.replace(out)  # whole or absent for the controller


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice (plain load)
def pytest_xdist_make_scheduler(config, log):
  """The controller's scheduler under ``-n N``: ``load``, except the groups written above are one unit each."""
  if not (config.getvalue("dist") == "load" and _grouped(config) and _GROUPS_ENV in os.environ):
    return None
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=import-outside-toplevel

  class FixtureGroupScheduling(LoadScopeScheduling):
    """Units: a group of tests sharing a module's fixture, else one test; largest units first."""

    _groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
      # Read once, when scheduling starts: after every worker has collected (and written its file).
      if self._groups is None:
        files = sorted(pathlib.Path(os.environ[_GROUPS_ENV]).glob("*.json"))
        self._groups = json.loads(files[0].read_text()) if files else {}
      return self._groups.get(nodeid, nodeid)

  return FixtureGroupScheduling(config, log)


def _deselect_slow(config, items):
  """Leave out the tests marked ``slow`` unless ``-m`` chooses (``-m slow``: only them; CI runs both).

  A ``-m`` expression decides on its own, so ``-m slow`` and ``-m "slow or not slow"`` work as written;
  without one the default run is the fast suite, and the summary counts the left-out tests as deselected.
  """
  if config.getoption("markexpr"):
    return
  slow = [item for item in items if item.get_closest_marker("slow") is not None]
  if slow:
    config.hook.pytest_deselected(items=slow)
    items[:] = [item for item in items if item.get_closest_marker("slow") is None]
