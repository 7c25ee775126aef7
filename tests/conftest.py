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


def pytest_collection_modifyitems(config, items):
  """Slow tests out unless chosen (:func:`_deselect_slow`)."""
  _deselect_slow(config, items)


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


@pytest.fixture
def x64():
  """Float64 for the test (``pytestmark = pytest.mark.usefixtures("x64")`` for a whole module)."""
  import jax  # pylint: disable=import-outside-toplevel  (after the platform is chosen above)

  with jax.enable_x64(True):
    yield
