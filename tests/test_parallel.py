"""ntk_fl.parallel: chunked vmap, bounded memory, and the sharded path on 4 CPU devices.

The multi-device checks run in a subprocess (``tests/multidevice_check.py``):
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` must be set before jax
initialises, and this process already has one CPU device. There, the same
computations -- a toy per-client function with captured arrays (M = 3, 6, 8 on
4 devices, with and without chunking), a nested ``for_each_client``, NTK-DFL and
DFedAvg rounds (M = 6: not a multiple of 4), rows of a ``parallel.Shared`` table
split over the devices, rounds whose federation keeps each device's clients'
samples on that device only (``distributed.place_federation``), and a run
through the runner with ``config.devices`` -- are done on the single-device path
and sharded, and this file compares them.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import parallel, plotting, rundir, runner, schema
from ntk_fl.config import load_config

REPO = pathlib.Path(__file__).resolve().parents[1]
# float32 programs partitioned differently may reorder sums (e.g. the mixing step's gathers).
RTOL, ATOL = 2e-5, 2e-6


def _loop(fn, *stacked):
  """Brute force: fn client by client, restacked."""
  m = jax.tree.leaves(stacked)[0].shape[0]
  outs = [fn(*jax.tree.map(lambda a, i=i: a[i], stacked)) for i in range(m)]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _client_fn(p, x):
  return {"y": jnp.tanh(x @ p["w"]) + p["b"], "s": jnp.sum(x**2)}


@pytest.mark.parametrize("m,chunk", [(7, None), (7, 0), (7, 1), (7, 3), (7, 7), (7, 50), (1, 2)])
def test_for_each_client_equals_a_loop_over_clients(m, chunk):
  rng = np.random.default_rng(m)
  params = {
    "w": jnp.asarray(rng.normal(size=(m, 4, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(m, 3)), jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(m, 5, 4)), jnp.float32)
  got = jax.jit(parallel.for_each_client(_client_fn, chunk_size=chunk))(params, x)
  want = _loop(_client_fn, params, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def _temp_bytes(m, chunk):
  """XLA's planned scratch memory for m clients, each materialising two [512, 512] matrices."""

  def one(x):
    a = jnp.sin(x[:, None] * x[None, :])
    b = a @ a  # a dot's operands and output live in memory
    return b.sum() + jnp.trace(b[:8, :8])

  mapped = jax.jit(parallel.for_each_client(one, chunk_size=chunk))
  compiled = mapped.lower(jax.ShapeDtypeStruct((m, 512), jnp.float32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def _group_fns(groups):
  """Per-group functions of different cost and result: group g reads the first g + 1 rows of x."""
  return [
    lambda p, x, g=g: {
      "y": jnp.tanh(x[: g + 1].sum(0) @ p["w"]) * (g + 1) + p["b"],
      "g": jnp.int32(g),
    }
    for g in range(groups)
  ]


@pytest.mark.parametrize(
  "m,chunk", [(9, None), (9, 0), (9, 1), (9, 2), (9, 4), (9, 9), (9, 50), (1, 1)]
)
def test_for_each_client_by_group_equals_a_loop_over_each_clients_group(m, chunk):
  """Client i runs fns[group[i]] (chunks of 1, 2, 4: groups of every size, part-filled last chunks);
  where grouping cannot pay (chunk 0, None = all at once, chunk >= M) every client runs fns[-1]."""
  rng = np.random.default_rng(m)
  params = {
    "w": jnp.asarray(rng.normal(size=(m, 4, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(m, 3)), jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(m, 5, 4)), jnp.float32)
  group = jnp.asarray([3, 0, 1, 3, -2, 0, 3, 7, 1][:m])  # -2 and 7 lie outside [0, 4): clipped
  fns = _group_fns(4)
  got = jax.jit(parallel.for_each_client_by_group(fns, chunk_size=chunk))(group, params, x)
  grouped = bool(chunk) and chunk < m
  runs = np.clip(np.asarray(group), 0, 3) if grouped else np.full(m, 3)
  want = _loop(lambda g, p, xi: fns[int(g)](p, xi), jnp.asarray(runs), params, x)
  np.testing.assert_array_equal(np.asarray(got["g"]), runs)
  np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6, atol=1e-6)


def test_for_each_client_by_group_reads_shared_arguments_whole_and_in_debug_mode_runs_each_clients_group():
  table = jnp.arange(12.0).reshape(6, 2)
  fns = [lambda t, i, g=g: t.take(i[None])[0] * (g + 1) for g in range(3)]
  group, index = jnp.asarray([2, 0, 1, 1, 0, 2]), jnp.asarray([5, 4, 3, 2, 1, 0])
  want = np.asarray(table)[np.asarray(index)] * (np.asarray(group)[:, None] + 1)
  shared = parallel.Shared(table)
  got = jax.jit(lambda g, i: parallel.for_each_client_by_group(fns, chunk_size=2)(g, shared, i))(
    group, index
  )
  np.testing.assert_array_equal(np.asarray(got), want)
  with parallel.use_devices(1, debug=True):
    np.testing.assert_array_equal(
      np.asarray(parallel.for_each_client_by_group(fns)(group, shared, index)), want
    )


def test_for_each_client_by_group_needs_functions():
  with pytest.raises(ValueError, match="non-empty sequence of functions"):
    parallel.for_each_client_by_group([])
  with pytest.raises(ValueError, match="chunk_size"):
    parallel.for_each_client_by_group([jnp.sin], chunk_size=-1)


def test_chunking_bounds_scratch_memory_by_the_chunk_not_by_m():
  per_client = 2 * 512 * 512 * 4
  chunked_small, chunked_large = _temp_bytes(16, 4), _temp_bytes(64, 4)
  unchunked_small, unchunked_large = _temp_bytes(16, 0), _temp_bytes(64, 0)
  assert chunked_large <= chunked_small + 64 * 512 * 4 * 2  # grows at most by O(M · input row)
  assert chunked_large <= 4 * per_client * 1.01  # one chunk of 4 clients' intermediates
  assert unchunked_large >= 4 * unchunked_small * 0.99  # plain vmap grows with M ...
  assert unchunked_large >= 64 * per_client * 0.99  # ... holding all 64 clients' at once


def test_single_device_context_is_the_plain_path():
  assert jax.device_count() == 1
  with parallel.use_devices(0) as mesh:
    assert mesh is None
    assert parallel.num_client_shards() == 1
  with parallel.use_devices(1) as mesh:
    assert mesh is None
  mesh = parallel.make_client_mesh(0)
  assert mesh.axis_names == (parallel.CLIENTS,) and mesh.size == 1


@pytest.mark.parametrize(
  "devices,match",
  [
    (2, "only 1 cpu device"),
    (-1, "devices"),
    (True, "devices"),
    (1.5, "devices"),
    ([], "at least one device"),
  ],
)
def test_bad_device_counts_raise(devices, match):
  with pytest.raises(ValueError, match=match):
    parallel.make_client_mesh(devices)


@pytest.mark.parametrize("chunk", [-1, 2.0, True])
def test_bad_chunk_size_raises_at_once(chunk):
  with pytest.raises(ValueError, match="chunk_size"):
    parallel.for_each_client(_client_fn, chunk_size=chunk)


def test_the_device_policy_sets_the_chunk_size_of_maps_that_name_none():
  rng = np.random.default_rng(0)
  params = {
    "w": jnp.asarray(rng.normal(size=(7, 4, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(7, 3)), jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(7, 5, 4)), jnp.float32)
  by_policy = parallel.for_each_client(_client_fn)  # no chunk size of its own
  all_at_once = parallel.for_each_client(_client_fn, chunk_size=0)
  # lax.map over chunks traces a scan. A fresh wrapper per check: jax reuses the trace of a function it has seen,
  # which is why the policy must be in force when a step is first traced.
  chunked = lambda fn: "scan" in str(jax.make_jaxpr(lambda *args: fn(*args))(params, x))
  assert parallel.policy_chunk_size() == 0 and not chunked(
    by_policy
  )  # outside any policy: plain vmap
  with parallel.use_devices(1, chunk_size=3):
    assert parallel.policy_chunk_size() == 3
    assert chunked(by_policy) and not chunked(all_at_once)
    with parallel.use_devices(1):  # the innermost policy wins
      assert not chunked(by_policy)
    np.testing.assert_allclose(
      by_policy(params, x)["y"], all_at_once(params, x)["y"], rtol=1e-6, atol=1e-6
    )
  assert parallel.policy_chunk_size() == 0
  with pytest.raises(ValueError, match="chunk_size"):
    with parallel.use_devices(1, chunk_size=-1):
      pass


def test_mismatched_or_missing_client_axes_raise():
  mapped = parallel.for_each_client(lambda a, b: a + b)
  with pytest.raises(ValueError, match="same leading client axis"):
    mapped(jnp.zeros((3, 2)), jnp.zeros((4, 2)))
  with pytest.raises(ValueError, match="same leading client axis"):
    mapped(jnp.zeros((3, 2)), jnp.float32(1))
  with pytest.raises(ValueError, match="at least one array"):
    parallel.for_each_client(lambda: 0)()


def _fails_for_client_3(client, x):
  if int(client) == 3:  # concrete values: the debug mode compiles nothing
    raise FloatingPointError(f"singular system, pivot {float(x[0]):.1f}")
  return x * 2


def test_debug_mode_names_the_failing_client_and_the_stage():
  clients = jnp.arange(6)
  x = jnp.arange(12.0).reshape(6, 2)
  with parallel.use_devices(1, debug=True):
    assert parallel.debug_clients()
    with pytest.raises(
      parallel.ClientError,
      match=r"client 3, stage '_fails_for_client_3': "
      r"FloatingPointError: singular system, pivot 6\.0",
    ) as info:
      # jit is off in debug mode: the jitted map still runs client by client with concrete values.
      jax.jit(parallel.for_each_client(_fails_for_client_3))(clients, x)
  assert info.value.client == 3 and info.value.stage == "_fails_for_client_3"
  assert isinstance(info.value.__cause__, FloatingPointError)
  assert not parallel.debug_clients()
  with pytest.raises(jax.errors.ConcretizationTypeError):  # outside it, the same function is traced
    jax.jit(parallel.for_each_client(_fails_for_client_3))(clients, x)
  with pytest.raises(ValueError, match="debug must be True or False"):
    with parallel.use_devices(1, debug="yes"):
      pass


def test_debug_mode_names_the_inner_client_of_a_nested_map():
  def inner(v):
    if float(v) < 0:
      raise ValueError("negative")
    return v

  def outer(row):
    return parallel.for_each_client(inner)(row)

  rows = jnp.asarray([[1.0, 2.0], [3.0, -4.0]])
  with parallel.use_devices(1, debug=True):
    with pytest.raises(
      parallel.ClientError, match=r"client 1, stage '.*outer'.*client 1, stage '.*inner'"
    ):
      parallel.for_each_client(outer)(rows)


@pytest.mark.parametrize("chunk", [0, 3])
def test_debug_mode_equals_the_mapped_clients(chunk):
  rng = np.random.default_rng(1)
  params = {
    "w": jnp.asarray(rng.normal(size=(7, 4, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(7, 3)), jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(7, 5, 4)), jnp.float32)
  shared = parallel.Shared(jnp.asarray(rng.normal(size=(9, 3)), jnp.float32))
  fn = lambda p, rows, xi: {**_client_fn(p, xi), "r": rows.take(jnp.arange(2))}
  mapped = lambda p, xi: parallel.for_each_client(fn)(p, shared, xi)
  with parallel.use_devices(1, chunk_size=chunk):
    want = jax.jit(mapped)(params, x)
  with parallel.use_devices(1, chunk_size=chunk, debug=True):
    got = jax.jit(mapped)(params, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_a_run_with_debug_clients_equals_the_compiled_run(tmp_path, monkeypatch):
  config = load_config(str(REPO / "tests" / "configs" / "toy.py"), "smoke")
  config.rounds, config.checkpoint_every, config.eval.selection = 1, 0, False
  # The metrics are compared; the plots drawn from them after the rounds are tests/test_plotting.py's.
  monkeypatch.setattr(plotting, "plot_run", lambda *args, **kwargs: [])
  runner.run(config, str(tmp_path / "compiled"))
  config.debug_clients = True
  runner.run(config, str(tmp_path / "debug"))
  (compiled,), (debug,) = (
    rundir.read_metrics(str(tmp_path / name)) for name in ("compiled", "debug")
  )
  assert debug.keys() == compiled.keys()
  floats = [k for k, v in compiled.items() if isinstance(v, float) and not k.endswith("_time")]
  assert "test_acc" in floats
  for key in floats:
    np.testing.assert_allclose(debug[key], compiled[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for key, values in compiled["clients"].items():
    np.testing.assert_allclose(debug["clients"][key], values, rtol=1e-5, atol=1e-6, err_msg=key)
  stored = rundir.jsonable(config)
  stored["debug_clients"] = "yes"
  with pytest.raises(ValueError, match="config.debug_clients must be a bool"):
    schema.validate_config(stored)


@pytest.mark.parametrize("devices", [-1, 2])
def test_config_devices_is_validated_before_any_work(devices):
  config = load_config(str(REPO / "tests" / "configs" / "toy.py"), "smoke")
  config.devices = devices
  with pytest.raises(ValueError, match="config.devices"):
    schema.validate_config(config)


@pytest.fixture(scope="module")
def multidevice(tmp_path_factory, worker_id):
  """The subprocess's results, computed once per pytest session however many xdist workers ask.

  A module-scoped fixture is per worker, and the subprocess takes ≈ 80 s, so workers share one result
  under a lock in the session's common temp directory (the parent of each worker's basetemp).
  """
  root = tmp_path_factory.getbasetemp()
  if worker_id != "master":
    root = root.parent
  out = root / "multidevice"
  with open(root / "multidevice.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # the second worker waits here for the first one's results
    if not (out / "results.npz").exists():
      out.mkdir(exist_ok=True)
      env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
      proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "multidevice_check.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
      )
      assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with np.load(out / "results.npz") as f:
      return dict(f)


def _compare(results, name):
  single = sorted(k for k in results if k.startswith(f"{name}/single/"))
  assert single, f"no results for {name}"
  for key in single:
    a, b = results[key], results[key.replace("/single/", "/sharded/")]
    assert a.shape == b.shape, key
    if np.issubdtype(a.dtype, np.floating):
      assert np.all(np.isfinite(b)), key
      np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=key)
    else:
      np.testing.assert_array_equal(b, a, err_msg=key)


@pytest.mark.multidevice
@pytest.mark.slow  # the shared 4-device subprocess: about two CPU minutes (CI: -m slow)
@pytest.mark.parametrize("m", [3, 6, 8])
@pytest.mark.parametrize("chunk", ["None", "1"])
def test_sharded_toy_function_equals_single_device(multidevice, m, chunk):
  name = f"toy_m{m}_chunk{chunk}"
  _compare(multidevice, name)
  assert set(multidevice[f"{name}/shards"].tolist()) == {4}  # traced on the sharded path
  assert int(multidevice[f"{name}/devices"]) == 4  # and the result lives on all 4 devices


@pytest.mark.multidevice
@pytest.mark.slow  # the shared 4-device subprocess: about two CPU minutes (CI: -m slow)
def test_nested_for_each_client_shards_only_the_outer_axis(multidevice):
  _compare(multidevice, "nested_m6")
  assert set(multidevice["nested_m6/shards"].tolist()) == {1}  # inner call saw the manual axis


@pytest.mark.multidevice
@pytest.mark.slow  # the shared 4-device subprocess: about two CPU minutes (CI: -m slow)
@pytest.mark.parametrize(
  "name",
  [
    "ntk_dfl_m6",
    "ntk_dfl_m8_chunk1",
    "ntk_dfl_erdos_renyi_m8_chunk1",
    "spark_erdos_renyi_m8_chunk1",
    "dfedavg_m6",
  ],
)
def test_sharded_algorithm_rounds_equal_single_device(multidevice, name):
  _compare(multidevice, name)
  assert int(multidevice[f"{name}/devices"]) == 4


@pytest.mark.multidevice
@pytest.mark.slow  # the shared 4-device subprocess: about two CPU minutes (CI: -m slow)
@pytest.mark.parametrize("name", ["shared_m6_chunkNone", "shared_m7_chunk2"])
def test_shared_rows_split_over_devices_equal_the_direct_gather(multidevice, name):
  _compare(multidevice, name)
  assert set(multidevice[f"{name}/shards"].tolist()) == {4}
  # Leaves in key order: a, b, want_a. The rows fetched from their devices are the rows asked for, exactly.
  np.testing.assert_array_equal(multidevice[f"{name}/sharded/0"], multidevice[f"{name}/sharded/2"])
  np.testing.assert_array_equal(multidevice[f"{name}/sharded/1"] % 7, 0)


@pytest.mark.multidevice
@pytest.mark.slow  # the shared 4-device subprocess: about two CPU minutes (CI: -m slow)
@pytest.mark.parametrize(
  "name", ["ntk_dfl_m6_split", "ntk_dfl_m8_chunk1_split", "dfedavg_m6_split", "fedavg_m6_split"]
)
def test_rounds_with_samples_split_over_devices_equal_single_device(multidevice, name):
  """Each device holding only its clients' samples (a multi-process run's layout) changes no number."""
  _compare(multidevice, name)
  assert int(multidevice[f"{name}/devices"]) == 4


@pytest.mark.multidevice
@pytest.mark.slow  # the shared 4-device subprocess: about two CPU minutes (CI: -m slow)
def test_runner_with_config_devices_equals_single_device(multidevice):
  _compare(multidevice, "runner_toy")
