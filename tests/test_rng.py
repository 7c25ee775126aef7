"""The stream table: every stream of a seed is distinct from every other."""

import itertools

import jax
import numpy as np
import pytest

from ntk_fl import rng, topology
from ntk_fl.data import partition as partition_lib


def _first_draws(generator, count=8):
  return tuple(generator.integers(0, 2**62, size=count))


def test_numpy_streams_pairwise_distinct_including_round_indices():
  seed = 3
  draws = {("partition",): _first_draws(rng.numpy_rng(seed, rng.Stream.PARTITION))}
  for stream in rng.Stream:
    if stream == rng.Stream.PARTITION:
      continue
    draws[(stream.name,)] = _first_draws(rng.numpy_rng(seed, stream))
    for r in range(12):  # per-round streams: round indices must not alias other streams
      draws[(stream.name, r)] = _first_draws(rng.numpy_rng(seed, stream, r))
  # [seed, s] and [seed, s, 0] coincide (SeedSequence drops trailing zeros) -- same stream, never two users.
  for stream in rng.Stream:
    if stream != rng.Stream.PARTITION:
      assert draws[(stream.name,)] == draws[(stream.name, 0)]
      del draws[(stream.name, 0)]
  for (a, da), (b, db) in itertools.combinations(draws.items(), 2):
    assert da != db, (a, b)


def test_stream_ids_unique_and_only_partition_is_bare():
  ids = [int(s) for s in rng.Stream]
  assert len(set(ids)) == len(ids)
  assert [s for s in rng.Stream if int(s) == 0] == [rng.Stream.PARTITION]
  with pytest.raises(ValueError, match="partition stream"):
    rng.numpy_rng(0, rng.Stream.PARTITION, 1)


def test_partition_uses_the_bare_seed():
  # The iid split cuts one default_rng(seed) permutation (each client's indices sorted).
  labels = np.repeat(np.arange(4), 25)
  perm = np.random.default_rng(7).permutation(100)
  parts = partition_lib(labels, "iid", 2, seed=7)
  np.testing.assert_array_equal(parts[0], np.sort(perm[:50]))
  np.testing.assert_array_equal(parts[1], np.sort(perm[50:]))


def test_topology_round_streams_do_not_replay_the_partition_stream():
  # Before the stream table, round 0 drew from SeedSequence([seed, 0]) == default_rng(seed).
  seed = 5
  topo = topology.make_topology("regular", 20, seed=seed, degree=3)
  graphs = [topo.sample(r).neighbors for r in range(3)]
  assert not all(np.array_equal(graphs[0], g) for g in graphs[1:])
  expected = topology.graph_from_networkx(
    __import__("networkx").random_regular_graph(
      3, 20, seed=int(rng.numpy_rng(seed, rng.Stream.TOPOLOGY, 1).integers(2**31 - 1))
    ),
    topo.k_max,
    num_clients=20,
    round=1,
  )
  np.testing.assert_array_equal(graphs[1], expected.neighbors)


def test_jax_keys_distinct_per_stream_and_index():
  keys = [jax.random.key_data(rng.jax_key(0, s, r)) for s in rng.Stream for r in range(3)]
  flat = {tuple(np.asarray(k).ravel()) for k in keys}
  assert len(flat) == len(keys)
