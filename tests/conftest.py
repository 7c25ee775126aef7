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
"""

import atexit
import os
import pathlib
import resource
import shutil
import tempfile
import time

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


# The default suite's tier: the tests listed here are marked slow (opt-in) where they are collected.
SLOW_TESTS = pathlib.Path(__file__).with_name("slow_tests.txt")


def pytest_addoption(parser):
  parser.addoption(
    "--cpu-profile",
    metavar="PATH",
    help="append each test's node id, CPU seconds (its process and the subprocesses it waited for) "
    "and wall seconds to PATH, tab-separated (xdist workers append to the same file)",
  )


def pytest_collection_modifyitems(config, items):
  """Mark the listed tests slow (:func:`_mark_listed_slow`), then leave slow tests out unless chosen."""
  _mark_listed_slow(config, items, _read_slow_list(SLOW_TESTS))
  _deselect_slow(config, items)


def _read_slow_list(path):
  """Node ids of ``slow_tests.txt``: one per line, its first tab-separated field; ``#`` lines are comments."""
  lines = path.read_text().splitlines()
  return [line.split("\t", 1)[0] for line in lines if line.strip() and not line.startswith("#")]


def _mark_listed_slow(config, items, listed):
  """Add the ``slow`` marker to each listed test; a listed id absent from a whole collected file is an error.

  The check runs only for files collected whole (named by a path argument without ``::``), so running
  one test or a ``-k`` selection is never refused; a renamed or removed test left in the list is.
  """
  listed = set(listed)
  collected = {item.nodeid for item in items}
  for item in items:
    if item.nodeid in listed:
      item.add_marker(pytest.mark.slow)
  whole_files = {item.nodeid.split("::", 1)[0] for item in items if _collected_whole(config, item)}
  stale = sorted(i for i in listed - collected if i.split("::", 1)[0] in whole_files)
  if stale:
    raise pytest.UsageError(
      f"{SLOW_TESTS.name} lists tests that do not exist (renamed or removed?): {', '.join(stale)}"
    )


def _collected_whole(config, item):
  """Whether an argument (a directory or file, no ``::``) covers ``item``'s whole file."""
  path = pathlib.Path(str(item.path)).resolve()
  for arg in config.args:
    if "::" in arg:
      continue
    target = pathlib.Path(config.invocation_params.dir, arg).resolve()
    if path == target or target in path.parents:
      return True
  return False


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


def _cpu_seconds():
  """User + system CPU seconds of this process and of the subprocesses it has waited for."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """With ``--cpu-profile PATH``: append the test's CPU and wall seconds (setup, call and teardown)."""
  path = item.config.getoption("cpu_profile")
  if not path:
    yield
    return
  cpu, wall = _cpu_seconds(), time.perf_counter()
  yield
  line = f"{item.nodeid}\t{_cpu_seconds() - cpu:.2f}\t{time.perf_counter() - wall:.2f}\n"
  # One short append per test: the workers' lines do not interleave.
  with open(path, "a", encoding="utf-8") as f:
    f.write(line)


@pytest.fixture
def x64():
  """Float64 for the test (``pytestmark = pytest.mark.usefixtures("x64")`` for a whole module)."""
  import jax  # pylint: disable=import-outside-toplevel  (after the platform is chosen above)

  with jax.enable_x64(True):
    yield
