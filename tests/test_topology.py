"""Tests for ntk_fl.topology: graph draws, padding, determinism, mixing weights, spectral gaps."""

from __future__ import annotations

import math

import chex
import jax
import networkx as nx
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ntk_fl import gossip
from ntk_fl import topology as T

_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def _make(name, m, seed=0, **kw):
  defaults = dict(degree=2, mean_degree=2.0, cluster_size=3)
  defaults.update(kw)
  return T.make_topology(name, m, seed=seed, **defaults)


def _assert_valid_graph(g: T.Graph, m: int, k_max: int):
  """Shape/dtype, symmetry, no self loops, padding = own index, real slots first and sorted."""
  assert g.neighbors.shape == (m, k_max) and g.mask.shape == (m, k_max)
  assert g.neighbors.dtype == np.int32 and g.mask.dtype == np.bool_
  own = np.arange(m)[:, None]
  deg = g.mask.sum(1)
  # Real neighbours occupy the first deg_i slots; the rest are padding holding i.
  assert np.array_equal(g.mask, np.arange(k_max)[None, :] < deg[:, None])
  assert np.all(np.where(g.mask, True, g.neighbors == own))
  assert not np.any(g.mask & (g.neighbors == own)), "self loop"
  for i in range(m):
    real = g.neighbors[i, : deg[i]]
    assert np.all(np.diff(real) > 0), "neighbours must be sorted and distinct"
    assert np.all((real >= 0) & (real < m))
  adj = np.zeros((m, m), dtype=bool)
  adj[np.nonzero(g.mask)[0], g.neighbors[g.mask]] = True
  assert np.array_equal(adj, adj.T), "graph must be symmetric"


# ------------------------------------------------------------------ structure


@_SETTINGS
@given(
  name=st.sampled_from(T.TOPOLOGIES),
  m=st.integers(6, 24),
  seed=st.integers(0, 2**20),
  round_=st.integers(0, 50),
)
def test_every_topology_yields_valid_padded_graphs(name, m, seed, round_):
  top = _make(name, m, seed)
  assert top.name == name and top.num_clients == m
  _assert_valid_graph(top.sample(round_), m, top.k_max)


@st.composite
def _regular_args(draw):
  m = draw(st.integers(3, 30))
  degree = draw(st.integers(1, m - 1))
  assume((m * degree) % 2 == 0)
  return m, degree


@_SETTINGS
@given(args=_regular_args(), seed=st.integers(0, 1000))
def test_regular_has_requested_degree(args, seed):
  m, degree = args
  top = T.make_topology("regular", m, seed=seed, degree=degree)
  g = top.sample(3)
  assert top.k_max == degree
  assert np.all(T.degrees(g) == degree)
  assert g.mask.all()  # k_max == degree: no padding at all


def test_topology_from_config_fields_equals_make_topology_with_those_arguments():
  fields = dict(name="erdos_renyi", degree=4, p=0.0, mean_degree=3.0, cluster_size=6)
  fields.update(dynamic=False, k_max=0, mixing="metropolis")  # mixing is not a graph argument
  built = T.topology_from_fields(fields, 30, seed=7)
  direct = T.make_topology("erdos_renyi", 30, seed=7, mean_degree=3.0, dynamic=False)
  assert built.k_max == direct.k_max and not built.dynamic
  for r in (0, 3):
    np.testing.assert_array_equal(built.sample(r).neighbors, direct.sample(r).neighbors)
  # Absent fields take make_topology's defaults (a config stored before the field existed).
  assert T.topology_from_fields({"name": "regular"}, 12, seed=0).k_max == 5


def test_ring_and_line_are_a_cycle_and_a_path_over_all_clients():
  m = 11
  ring = nx.Graph(T.graph_to_networkx(_make("ring", m, 4).sample(2)))
  line = nx.Graph(T.graph_to_networkx(_make("line", m, 4).sample(2)))
  assert nx.is_connected(ring) and ring.number_of_edges() == m
  assert all(d == 2 for _, d in ring.degree)
  assert (
    nx.is_tree(line) and max(d for _, d in line.degree) == 2
  )  # a tree of max degree 2 is a path
  assert sorted(d for _, d in line.degree)[:3] == [1, 1, 2]


def test_ring_order_is_a_random_permutation():
  # Not the identity cycle 0-1-2-...: the order is shuffled (and re-shuffled per round).
  g = nx.Graph(T.graph_to_networkx(_make("ring", 30, 0).sample(0)))
  assert set(g.edges) != set(nx.cycle_graph(30).edges)


def test_complete_graph():
  m = 7
  top = _make("complete", m)
  g = top.sample(5)
  assert top.k_max == m - 1
  assert np.array_equal(g.neighbors, [[j for j in range(m) if j != i] for i in range(m)])


@pytest.mark.parametrize("m,cluster_size", [(18, 6), (20, 6), (23, 6), (11, 4), (7, 7)])
def test_clustered_is_disjoint_cliques_of_at_least_cluster_size(m, cluster_size):
  top = T.make_topology("clustered", m, seed=3, cluster_size=cluster_size)
  g = T.graph_to_networkx(top.sample(1))
  components = [sorted(c) for c in nx.connected_components(g)]
  sizes = sorted(len(c) for c in components)
  assert len(components) == m // cluster_size == top.cliques
  assert sizes[0] >= cluster_size and sizes[-1] - sizes[0] <= 1
  for c in components:  # each component is a clique
    assert g.subgraph(c).number_of_edges() == len(c) * (len(c) - 1) // 2
  assert top.k_max == math.ceil(m / (m // cluster_size)) - 1 == sizes[-1] - 1


def test_erdos_renyi_mean_degree_matches_p_and_statistics():
  m, mean_degree = 200, 5.0
  by_mean = T.make_topology("erdos_renyi", m, seed=9, mean_degree=mean_degree)
  by_p = T.make_topology("erdos_renyi", m, seed=9, p=mean_degree / (m - 1))
  degs = []
  for r in range(20):
    g = by_mean.sample(r)
    np.testing.assert_array_equal(g.neighbors, by_p.sample(r).neighbors)
    degs.append(T.degrees(g))
  # Average degree over 20 * 200 clients: edges ~ Binomial(20 * C(200, 2), p), sd of the mean ~0.05.
  assert abs(np.mean(degs) - mean_degree) < 0.25


def _binomial_sf(k: int, n: int, p: float) -> float:
  return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k + 1, n + 1))


@pytest.mark.parametrize("m,mean_degree", [(30, 3.0), (100, 5.0), (300, 5.0)])
def test_erdos_renyi_k_max_is_the_union_bound_quantile(m, mean_degree):
  p = mean_degree / (m - 1)
  top = T.make_topology("erdos_renyi", m, seed=0, mean_degree=mean_degree)
  k = top.k_max
  # Brute-force binomial tails (math.comb, independent of scipy).
  assert m * _binomial_sf(k, m - 1, p) < 1e-6 <= m * _binomial_sf(k - 1, m - 1, p)


def test_explicit_k_max_pads_with_own_index():
  top = T.make_topology("regular", 10, seed=0, degree=3, k_max=7)
  g = top.sample(0)
  _assert_valid_graph(g, 10, 7)
  assert np.all(T.degrees(g) == 3)
  np.testing.assert_array_equal(g.neighbors[:, 3:], np.repeat(np.arange(10)[:, None], 4, 1))


def test_networkx_round_trip():
  g = _make("erdos_renyi", 25, 1, mean_degree=4.0).sample(0)
  back = T.graph_from_networkx(T.graph_to_networkx(g), g.neighbors.shape[1])
  np.testing.assert_array_equal(back.neighbors, g.neighbors)
  np.testing.assert_array_equal(back.mask, g.mask)


# -------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", ["regular", "erdos_renyi", "ring", "line", "clustered"])
def test_dynamic_draws_depend_on_seed_and_round_only(name):
  a, b = _make(name, 20, seed=5), _make(name, 20, seed=5)
  np.testing.assert_array_equal(a.sample(4).neighbors, b.sample(4).neighbors)
  np.testing.assert_array_equal(a.sample(4).neighbors, a.sample(4).neighbors)
  draws = [a.sample(r).neighbors for r in range(4)]
  for i in range(4):
    for j in range(i + 1, 4):
      assert not np.array_equal(draws[i], draws[j]), f"rounds {i} and {j} drew the same graph"
  assert not np.array_equal(_make(name, 20, seed=6).sample(0).neighbors, draws[0])


@pytest.mark.parametrize("name", ["regular", "erdos_renyi", "ring", "line", "clustered"])
def test_static_topology_repeats_the_round_zero_graph(name):
  static = _make(name, 20, seed=5, dynamic=False)
  dynamic = _make(name, 20, seed=5)
  first = static.sample(0).neighbors
  for r in (1, 2, 17):
    np.testing.assert_array_equal(static.sample(r).neighbors, first)
  np.testing.assert_array_equal(first, dynamic.sample(0).neighbors)


def test_draws_ignore_global_numpy_state():
  top = _make("regular", 16, seed=2)
  np.random.seed(0)
  a = top.sample(3).neighbors
  np.random.seed(123)
  np.random.rand(10)
  np.testing.assert_array_equal(top.sample(3).neighbors, a)


# ------------------------------------------------------------------- families


def test_only_the_clustered_family_declares_cliques():
  for name in ("regular", "erdos_renyi", "ring", "line", "complete"):
    assert T.make_topology(name, 12, seed=0, degree=3, mean_degree=3.0).cliques == 0


# ------------------------------------------------------------------- errors


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(name="regular", num_clients=7, degree=3), r"even, got 7 \* 3 = 21"),
    (dict(name="regular", num_clients=6, degree=6), r"degree must be an int in \[1, 5\], got 6"),
    (dict(name="regular", num_clients=6, degree=0), r"degree must be an int in \[1, 5\], got 0"),
    (dict(name="regular", num_clients=10, degree=4, k_max=3), "k_max=3 is below the degree 4"),
    (dict(name="torus", num_clients=10), r"unknown topology 'torus'.*regular.*clustered"),
    (dict(name="erdos_renyi", num_clients=10, p=0.1, mean_degree=2.0), "exactly one of p"),
    (dict(name="erdos_renyi", num_clients=10, p=0.0, mean_degree=0.0), "exactly one of p"),
    (dict(name="erdos_renyi", num_clients=10, p=1.5), r"p must be in \(0, 1\]"),
    (dict(name="erdos_renyi", num_clients=10, mean_degree=12.0), "mean_degree must be <= "),
    (dict(name="ring", num_clients=2), "ring needs num_clients >= 3"),
    (
      dict(name="clustered", num_clients=5, cluster_size=6),
      r"cluster_size must be an int in \[2, 5\]",
    ),
    (dict(name="complete", num_clients=1), "num_clients must be an int >= 2"),
    (dict(name="complete", num_clients=5, seed=-1), "seed must be an int >= 0"),
  ],
)
def test_bad_arguments_raise_early(kwargs, match):
  kwargs.setdefault("seed", 0)
  with pytest.raises(ValueError, match=match):
    T.make_topology(**kwargs)


def test_graph_denser_than_k_max_names_round_degree_and_k_max():
  top = T.make_topology("erdos_renyi", 20, seed=0, p=0.9, k_max=3)
  with pytest.raises(
    ValueError, match=r"round 4: drawn graph has a client of degree \d+ > k_max=3"
  ):
    top.sample(4)


def test_negative_round_raises():
  with pytest.raises(ValueError, match="round must be an int >= 0"):
    _make("ring", 5).sample(-1)


def test_mixing_argument_errors():
  g = _make("ring", 6).sample(0)
  with pytest.raises(ValueError, match=r"unknown mixing scheme 'max'.*uniform.*metropolis"):
    T.mixing_weights(g, "max")
  with pytest.raises(ValueError, match="'data_size' needs sizes"):
    T.mixing_weights(g, "data_size")
  with pytest.raises(ValueError, match=r"sizes must have shape \(6,\)"):
    T.mixing_weights(g, "data_size", np.ones(5))
  with pytest.raises(ValueError, match="sizes must be finite and >= 0"):
    T.mixing_weights(g, "data_size", -np.ones(6))


# ------------------------------------------------------------ mixing weights


@_SETTINGS
@given(
  name=st.sampled_from(T.TOPOLOGIES),
  scheme=st.sampled_from(T.MIXING_SCHEMES),
  m=st.integers(6, 20),
  seed=st.integers(0, 1000),
)
def test_mixing_rows_sum_to_one_and_padding_is_zero(name, scheme, m, seed):
  g = _make(name, m, seed).sample(1)
  sizes = np.random.default_rng(seed).integers(1, 50, size=m)
  self_w, nbr_w = T.mixing_weights(g, scheme, sizes)
  assert self_w.dtype == nbr_w.dtype == np.float32
  assert np.all(self_w >= 0) and np.all(nbr_w >= 0)
  assert np.all(nbr_w[~g.mask] == 0)
  np.testing.assert_allclose(self_w + nbr_w.sum(1), 1.0, atol=1e-6)
  w = T.mixing_matrix(g, scheme, sizes)
  np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-6)
  # The dense matrix and the padded gather are the same linear map.
  v = np.random.default_rng(seed + 1).normal(size=(m, 3))
  gathered = self_w[:, None] * v + np.einsum("ik,ikd->id", nbr_w, v[g.neighbors])
  np.testing.assert_allclose(w @ v, gathered, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "name,scheme",
  [
    ("erdos_renyi", "metropolis"),
    ("line", "metropolis"),
    ("clustered", "metropolis"),
    ("regular", "uniform"),
    ("ring", "uniform"),
    ("complete", "uniform"),
  ],
)
def test_doubly_stochastic_schemes_are_symmetric_and_preserve_the_mean(name, scheme):
  m = 21 if name != "regular" else 20
  g = _make(name, m, 7, degree=3, mean_degree=3.0, cluster_size=4).sample(2)
  w = T.mixing_matrix(g, scheme)
  np.testing.assert_allclose(w, w.T, atol=1e-7)
  np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-6)
  np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-6)
  v = np.random.default_rng(0).normal(size=(m, 5)).astype(np.float32)
  mixed = v
  for _ in range(10):  # repeated gossip keeps the network mean
    mixed = w @ mixed
  np.testing.assert_allclose(mixed.mean(0), v.mean(0), atol=1e-5)


def test_metropolis_weights_by_hand():
  # Star 0-{1,2,3} plus edge 3-4: deg = [3, 1, 1, 2, 1].
  g = T.graph_from_networkx(nx.Graph([(0, 1), (0, 2), (0, 3), (3, 4)]), 3)
  w = T.mixing_matrix(g, "metropolis").astype(np.float64)
  expected = np.array(
    [
      [1 - 3 / 4, 1 / 4, 1 / 4, 1 / 4, 0],
      [1 / 4, 3 / 4, 0, 0, 0],
      [1 / 4, 0, 3 / 4, 0, 0],
      [1 / 4, 0, 0, 1 - 1 / 4 - 1 / 3, 1 / 3],
      [0, 0, 0, 1 / 3, 2 / 3],
    ]
  )
  np.testing.assert_allclose(w, expected, atol=1e-7)


def test_uniform_on_an_irregular_graph_is_not_symmetric():
  w = T.mixing_matrix(_make("line", 5).sample(0), "uniform")
  assert not np.allclose(w, w.T)
  with pytest.raises(ValueError, match="W must be symmetric"):
    T.spectral_gap(w)


def test_data_size_weights_match_eq1_by_hand():
  # Path 0-1-2 (client 3 isolated), sizes N = [1, 2, 3, 4]; w_ij = N_j / (N_i + sum_{j in N(i)} N_j).
  nxg = nx.path_graph(3)
  nxg.add_node(3)
  g = T.graph_from_networkx(nxg, 2)
  w = T.mixing_matrix(g, "data_size", np.array([1, 2, 3, 4])).astype(np.float64)
  expected = np.array(
    [
      [1 / 3, 2 / 3, 0, 0],
      [1 / 6, 2 / 6, 3 / 6, 0],
      [0, 2 / 5, 3 / 5, 0],
      [0, 0, 0, 1],
    ]
  )
  np.testing.assert_allclose(w, expected, atol=1e-7)
  # Equal sizes reduce eq. 1 to the uniform 1 / (deg + 1) average of the authors' code.
  sw_d, nw_d = T.mixing_weights(g, "data_size", np.full(4, 7.0))
  sw_u, nw_u = T.mixing_weights(g, "uniform")
  np.testing.assert_allclose(sw_d, sw_u, atol=1e-7)
  np.testing.assert_allclose(nw_d, nw_u, atol=1e-7)


# -------------------------------------------------------------- spectral gap


def test_spectral_gap_of_complete_graph_with_uniform_weights_is_one():
  w = T.mixing_matrix(_make("complete", 12).sample(0), "uniform")  # W = 11^T / M
  assert T.slem(w) == pytest.approx(0.0, abs=1e-6)
  assert T.spectral_gap(w) == pytest.approx(1.0, abs=1e-6)
  assert T.squared_spectral_gap(w) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("m", [10, 50, 51])
def test_spectral_gap_of_ring_matches_circulant_closed_form(m):
  w = T.mixing_matrix(_make("ring", m, 3).sample(0), "uniform")
  # Circulant W with 1/3 on the diagonal and both neighbours: eigenvalues
  # (1 + 2 cos(2 pi k / M)) / 3; the second largest in modulus is k = 1.
  expected_gap = 1.0 - (1.0 + 2.0 * math.cos(2.0 * math.pi / m)) / 3.0
  assert T.spectral_gap(w) == pytest.approx(expected_gap, rel=1e-4)
  assert T.squared_spectral_gap(w) == pytest.approx(expected_gap**2, rel=2e-4)
  if m >= 50:
    assert T.spectral_gap(w) < 0.02  # rings mix slowly


def test_spectral_gap_of_disconnected_graph_is_zero():
  w = T.mixing_matrix(_make("clustered", 12, cluster_size=4).sample(0), "uniform")
  assert T.spectral_gap(w) == pytest.approx(0.0, abs=1e-6)


def test_spectral_gap_rejects_non_stochastic_matrices():
  with pytest.raises(ValueError, match="rows must sum to 1"):
    T.spectral_gap(np.eye(4) * 0.5)
  with pytest.raises(ValueError, match="square"):
    T.spectral_gap(np.ones((2, 3)) / 3)


class MixTest(chex.TestCase):
  """gossip.mix against the dense mixing matrix, called directly and under jit (chex.variants)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_mix_uses_own_exact_weights_and_neighbours_transmitted_ones(self):
    graph = T.make_topology("regular", 10, seed=2, degree=3).sample(0)
    self_w, nbr_w = T.mixing_weights(graph, "metropolis")
    dense = T.mixing_matrix(graph, "metropolis").astype(np.float64)
    rng = np.random.default_rng(0)
    w = {
      "w": rng.normal(size=(10, 4)).astype(np.float32),
      "b": rng.normal(size=(10,)).astype(np.float32),
    }
    sent = jax.tree.map(lambda a: (a + rng.normal(size=a.shape) * 0.1).astype(np.float32), w)
    mix = self.variant(gossip.mix)
    out = mix(w, graph.neighbors, self_w, nbr_w, sent=sent)
    off_diagonal = dense - np.diag(np.diag(dense))
    want = jax.tree.map(
      lambda own, s: (
        np.diag(dense).reshape(-1, *(1,) * (own.ndim - 1)) * own
        + np.tensordot(off_diagonal, s, axes=1)
      ),
      w,
      sent,
    )
    chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, w)
    exact = mix(w, graph.neighbors, self_w, nbr_w)
    chex.assert_trees_all_close(
      exact, jax.tree.map(lambda a: np.tensordot(dense, a, axes=1), w), rtol=1e-5, atol=1e-6
    )


def test_mix_checks_shapes_at_the_boundary():
  graph = T.make_topology("regular", 6, seed=0, degree=2).sample(0)
  self_w, nbr_w = T.mixing_weights(graph)
  w = {"w": np.zeros((6, 3), np.float32)}
  with pytest.raises(
    AssertionError, match="tree_shape_prefix"
  ):  # 5 clients' params, a 6-client graph
    gossip.mix({"w": np.zeros((5, 3), np.float32)}, graph.neighbors, self_w, nbr_w)
  with pytest.raises(AssertionError, match="equal_shapes"):  # what was sent is shaped differently
    gossip.mix(w, graph.neighbors, self_w, nbr_w, sent={"w": np.zeros((6, 4), np.float32)})
  with pytest.raises(AssertionError, match=r"assert_shape"):  # weights of another graph
    gossip.mix(w, graph.neighbors, self_w[:5], nbr_w)
  with pytest.raises(AssertionError, match=r"assert_type"):  # a float neighbour table
    T.mixing_weights(T.Graph(graph.neighbors.astype(np.float32), graph.mask))


def test_mix_does_not_materialise_the_gathered_neighbour_slots():
  # benchmarks/gossip_step.py checks gossip.mix against the one-gather formulation it replaced;
  # the slot-by-slot sum must need far less XLA scratch than the [M, k, 784, 100] gather of the first layer.
  from scripts import load_benchmark  # pylint: disable=import-outside-toplevel

  clients, degree = 12, 3
  result = load_benchmark("gossip_step").main(
    [f"--clients={clients}", f"--degree={degree}", "--repeats=1"]
  )
  gathered_bytes = clients * degree * 784 * 100 * 4
  assert result["before_temp"] >= gathered_bytes
  assert result["after_temp"] < gathered_bytes // 4


def test_mix_one_is_a_row_of_mix_inside_for_each_client():
  """Each client's average formed in its own chunk (mix_one under for_each_client) equals mix's row."""
  from ntk_fl import parallel  # pylint: disable=import-outside-toplevel

  graph = T.make_topology("erdos_renyi", 9, seed=3, mean_degree=3).sample(
    2
  )  # ragged degrees: padded slots
  sizes = np.arange(1, 10, dtype=np.float32)
  self_w, nbr_w = T.mixing_weights(graph, "data_size", sizes)
  rng = np.random.default_rng(0)
  w = {
    "a": rng.normal(size=(9, 4, 3)).astype(np.float32),
    "b": rng.normal(size=(9,)).astype(np.float32),
  }
  want = gossip.mix(w, graph.neighbors, self_w, nbr_w)
  one = lambda own, nbrs, s, a: gossip.mix_one(w, own, nbrs, s, a)
  for chunk in (None, 2):
    got = jax.jit(parallel.for_each_client(one, chunk_size=chunk))(
      w, graph.neighbors, self_w, nbr_w
    )
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  # and against the definition, client by client
  for i in range(9):
    expected = jax.tree.map(
      lambda a: (
        self_w[i] * a[i]
        + sum(nbr_w[i, k] * a[graph.neighbors[i, k]] for k in range(graph.neighbors.shape[1]))
      ),
      w,
    )
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[i], want), expected, rtol=1e-6, atol=1e-7)


def test_mix_and_mix_one_use_every_neighbour_slot():
  """A graph whose clients fill all their slots (a 3-regular graph: no padding), so the last slot counts."""
  from ntk_fl import parallel  # pylint: disable=import-outside-toplevel

  graph = T.make_topology("regular", 8, seed=1, degree=3).sample(0)
  assert graph.neighbors.shape == (8, 3) and np.asarray(graph.mask).all()
  self_w, nbr_w = T.mixing_weights(graph, "data_size", np.arange(1, 9, dtype=np.float32))
  assert (np.asarray(nbr_w)[:, -1] > 0).all()
  w = {"a": np.random.default_rng(1).normal(size=(8, 5)).astype(np.float32)}
  expected = {
    "a": np.stack(
      [
        self_w[i] * w["a"][i] + sum(nbr_w[i, k] * w["a"][graph.neighbors[i, k]] for k in range(3))
        for i in range(8)
      ]
    )
  }
  chex.assert_trees_all_close(
    gossip.mix(w, graph.neighbors, self_w, nbr_w), expected, rtol=1e-6, atol=1e-7
  )
  one = lambda own, nbrs, s, a: gossip.mix_one(w, own, nbrs, s, a)
  got = jax.jit(parallel.for_each_client(one, chunk_size=None))(w, graph.neighbors, self_w, nbr_w)
  chex.assert_trees_all_close(got, expected, rtol=1e-6, atol=1e-7)
