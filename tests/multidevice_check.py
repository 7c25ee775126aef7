"""Runs the same computations on the single-device path and sharded over 4 CPU devices.

Launched by ``tests/test_parallel.py`` in a subprocess (``XLA_FLAGS`` must be set
before jax initialises; the pytest process already has one CPU device):

  python tests/multidevice_check.py OUT_DIR

Writes ``OUT_DIR/results.npz``: for every case ``<name>/single/<i>`` and
``<name>/sharded/<i>`` (the flattened output leaves) plus ``<name>/shards`` (how
many devices ``for_each_client`` split clients over while tracing) and
``<name>/devices`` (devices the sharded output lives on). The comparison and
every assertion live in the test. Without a mesh, a 4-device process runs the
exact single-device code (everything on device 0), so one process serves both.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (after the environment is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from ntk_fl import distributed, models, parallel, rundir, runner  # noqa: E402
from ntk_fl.config import load_config  # noqa: E402
from ntk_fl.data import Federation, federation_from_padded  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
NUM_DEVICES = 4


def _leaves(tree):
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def _devices_of(tree):
  return max(
    len(leaf.sharding.device_set) for leaf in jax.tree.leaves(tree) if hasattr(leaf, "sharding")
  )


def toy_case(num_clients: int, chunk_size):
  """A per-client function with a mapped argument, a captured table and a captured scalar."""
  table = jnp.asarray(np.random.default_rng(1).normal(size=(num_clients, 7)), jnp.float32)
  weights = jnp.asarray(np.random.default_rng(2).normal(size=(7, 3)), jnp.float32)
  shards = []

  @jax.jit
  def run(params, index, scale):
    shards.append(parallel.num_client_shards())

    def one(p, i):
      nbr = table[(i + 1) % num_clients]  # gathers another client's row
      return {"out": jnp.tanh((table[i] + nbr) @ weights) * p * scale, "norm": jnp.sum(p**2)}

    return parallel.for_each_client(one, chunk_size=chunk_size)(params, index)

  params = jnp.asarray(np.random.default_rng(3).normal(size=(num_clients, 3)), jnp.float32)
  return lambda: run(params, jnp.arange(num_clients), jnp.float32(0.5)), shards


def nested_case():
  """``for_each_client`` inside a per-client function: the inner one must not shard again."""
  shards = []

  @jax.jit
  def run(params):
    def one(p):
      shards.append(parallel.num_client_shards())
      return parallel.for_each_client(lambda v: jnp.sin(v) * jnp.sum(p))(p)

    return parallel.for_each_client(one, chunk_size=2)(params)

  params = jnp.asarray(np.random.default_rng(4).normal(size=(6, 5)), jnp.float32)
  return lambda: run(params), shards


def _tiny_federation(num_clients: int, n_max: int = 8, seed: int = 0) -> Federation:
  rng = np.random.default_rng(seed)
  sizes = rng.integers(n_max - 3, n_max + 1, size=num_clients)
  x = np.zeros((num_clients, n_max, 5), np.float32)
  y = np.zeros((num_clients, n_max), np.int32)
  for i, n in enumerate(sizes):
    x[i, :n] = rng.normal(size=(n, 5))
    y[i, :n] = rng.integers(0, 3, size=n)
  mask = np.arange(n_max)[None] < sizes[:, None]
  return federation_from_padded(x, y, mask)


def shared_case(num_clients: int, chunk_size):
  """Rows of a :class:`parallel.Shared` table read by every client (split over the devices when sharded)."""
  table = {
    "a": jnp.asarray(np.random.default_rng(5).normal(size=(10, 3)), jnp.float32),
    "b": jnp.arange(10, dtype=jnp.int32) * 7,
  }
  rows = jnp.asarray(np.random.default_rng(6).integers(0, 10, size=(num_clients, 5)), jnp.int32)
  shards = []

  @jax.jit
  def run(rows):
    shards.append(parallel.num_client_shards())
    shared = parallel.Shared(table, split=parallel.num_client_shards() > 1)

    def one(store, r):
      got = store.take(r)
      return {
        "a": got["a"],
        "b": got["b"],
        "want_a": table["a"][r],
      }  # the direct gather, to compare

    return parallel.for_each_client(one, chunk_size=chunk_size)(shared, rows)

  return lambda: run(rows), shards


def _split_like(federation: Federation) -> Federation:
  """``federation``'s clients with their samples split over the current mesh's devices."""
  index, mask = np.asarray(federation.index), np.asarray(federation.mask)
  clients = [index[m][mask[m]] for m in range(mask.shape[0])]
  return distributed.place_federation(
    np.asarray(federation.samples_x)[:-1],
    np.asarray(federation.samples_y)[:-1],
    clients,
    parallel.current_mesh(),
  )


def algorithm_case(
  method: str,
  num_clients: int,
  chunk_size: int,
  rounds: int = 2,
  split: bool = False,
  erdos_renyi: bool = False,
):
  """``rounds`` rounds of ``method`` on a tiny federation (MLP 5-8-3, degree-2 dynamic graphs).

  ``split``: on the sharded path the federation's samples are split over the devices
  (:func:`ntk_fl.distributed.place_federation`, what a multi-process run uses).
  ``erdos_renyi``: Erdős–Rényi graphs of mean degree 3 instead (NTK-DFL and SPARK then group each
  device's clients by degree).
  """
  config = load_config(os.path.join(REPO, "configs", f"{method}.py"))
  config.data.num_clients = num_clients
  config.topology.degree = 2
  if erdos_renyi:
    config.topology.name = "erdos_renyi"
    config.topology.mean_degree = 3.0
  if method in ("ntk_dfl", "spark"):
    config.algorithm.lr = 0.05
    config.algorithm.taus = (5, 10)
  else:
    config.algorithm.epochs = 1
    config.algorithm.batch_size = 4
  if method == "fedavg":
    config.algorithm.clients_per_round = 3
  model = models.mlp(input_dim=5, hidden=(8,), num_classes=3)
  federation = _tiny_federation(num_clients)
  if split and parallel.current_mesh() is not None:
    federation = _split_like(federation)
    assert parallel.is_client_split(federation.samples_x)
  algorithm = runner.make_algorithm(config, model, federation)

  def run():
    # The chunk size travels with the device policy: the same devices as the caller's, chunk_size clients a chunk.
    with parallel.use_devices(parallel.num_client_shards(), chunk_size=chunk_size):
      # Laid out as a run lays it out (the runner's initial state): clients over the devices, the rest
      # replicated, as the sharded step returns it, so the second round reuses the first one's program.
      key = jax.random.PRNGKey(0)
      layout = distributed.client_shardings(
        jax.eval_shape(algorithm.init, key), num_clients, parallel.current_mesh()
      )
      state = jax.jit(algorithm.init, out_shardings=layout)(key)
      for r in range(rounds):
        state, metrics = algorithm.step(state, algorithm.round_inputs(r))
    return {"params": algorithm.client_params(state), "metrics": metrics}

  return run, [None]


def runner_case(workdir: str, devices: int):
  """The toy method through ``runner.run`` (10 clients: not a multiple of 4), checkpoints included."""
  config = load_config(os.path.join(REPO, "tests", "configs", "toy.py"), "smoke")
  config.devices = devices
  config.rounds = 2
  config.eval.selection = False
  runner.run(config, os.path.join(workdir, f"devices{devices}"))
  lines = rundir.read_metrics(os.path.join(workdir, f"devices{devices}"))
  return [
    np.asarray([line[key] for line in lines], np.float64)
    for key in ("test_acc", "test_loss", "client_acc_mean", "deviation")
  ]


def main(out_dir: str) -> None:
  assert jax.device_count() == NUM_DEVICES, jax.devices()
  results = {}
  cases = {
    f"toy_m{m}_chunk{c}": (lambda m=m, c=c: toy_case(m, c)) for m in (3, 6, 8) for c in (None, 1)
  }
  cases.update(
    {
      "nested_m6": nested_case,
      "ntk_dfl_m6": lambda: algorithm_case("ntk_dfl", 6, chunk_size=0),
      "ntk_dfl_m8_chunk1": lambda: algorithm_case("ntk_dfl", 8, chunk_size=1, rounds=1),
      "ntk_dfl_erdos_renyi_m8_chunk1": lambda: algorithm_case(
        "ntk_dfl", 8, chunk_size=1, rounds=1, erdos_renyi=True
      ),
      # SPARK's grouped round carries per-client arguments too (velocities, member indices).
      "spark_erdos_renyi_m8_chunk1": lambda: algorithm_case(
        "spark", 8, chunk_size=1, rounds=2, erdos_renyi=True
      ),
      "dfedavg_m6": lambda: algorithm_case("dfedavg", 6, chunk_size=0),
      "shared_m6_chunkNone": lambda: shared_case(6, None),
      "shared_m7_chunk2": lambda: shared_case(7, 2),
      "ntk_dfl_m6_split": lambda: algorithm_case("ntk_dfl", 6, chunk_size=0, split=True),
      "ntk_dfl_m8_chunk1_split": lambda: algorithm_case(
        "ntk_dfl", 8, chunk_size=1, rounds=1, split=True
      ),
      "dfedavg_m6_split": lambda: algorithm_case("dfedavg", 6, chunk_size=0, split=True),
      "fedavg_m6_split": lambda: algorithm_case("fedavg", 6, chunk_size=0, split=True),
    }
  )
  for name, make in cases.items():
    started = time.perf_counter()
    # A fresh jitted function per path: the device policy is read at trace time and jit reuses traces.
    run, _ = make()
    single = run()
    with parallel.use_devices(NUM_DEVICES):
      run, shards = make()
      sharded = run()
    results[f"{name}/devices"] = _devices_of(sharded)
    if shards and shards[0] is not None:
      results[f"{name}/shards"] = np.asarray(shards)
    for tag, tree in (("single", single), ("sharded", sharded)):
      for i, leaf in enumerate(_leaves(tree)):
        results[f"{name}/{tag}/{i}"] = leaf
    print(f"{name}: {time.perf_counter() - started:.1f} s", flush=True)
  started = time.perf_counter()
  for devices, tag in ((1, "single"), (0, "sharded")):
    for i, leaf in enumerate(runner_case(out_dir, devices)):
      results[f"runner_toy/{tag}/{i}"] = leaf
  print(f"runner_toy: {time.perf_counter() - started:.1f} s", flush=True)
  np.savez(os.path.join(out_dir, "results.npz"), **results)
  print("ok", len(results))


if __name__ == "__main__":
  main(sys.argv[1])
