"""Communication graphs, mixing weights and spectral gaps for decentralised FL.

A :class:`Topology` draws one undirected graph per round, deterministically in
``(seed, round)`` (the round's own stream, ``rng.numpy_rng(seed, Stream.TOPOLOGY,
round)``, never global RNG state). Static topologies return the round-0 graph every round;
dynamic ones re-draw. Graphs are generated with networkx and handed to JAX as a
fixed-shape padded adjacency list, :class:`Graph`, so a jit-compiled round never
recompiles when the graph changes:

* ``neighbors [M, k_max]`` int32: row ``i`` lists ``i``'s neighbours in
  ascending order, then padding slots that hold ``i`` itself;
* ``mask [M, k_max]`` bool: ``True`` marks a real neighbour.

Padding with the client's own index keeps every gather in-bounds and makes a
padded slot harmless whenever its weight is zero (see :func:`mixing_weights`).

Topologies (``TOPOLOGIES``) and their neighbour-slot bound ``k_max`` when the
caller passes ``k_max=0``:

===============  ==============================================================  =====================================
name             graph                                                           derived ``k_max``
===============  ==============================================================  =====================================
``regular``      random ``degree``-regular graph (``M*degree`` even)             ``degree``
``erdos_renyi``  G(M, p), ``p`` given or ``mean_degree / (M - 1)``               binomial tail bound (below)
``ring``         cycle through a random permutation of the clients               2
``line``         path through a random permutation of the clients                2 (1 when ``M = 2``)
``complete``     every pair connected (identical every round)                    ``M - 1``
``clustered``    random partition into ``M // cluster_size`` cliques             ``ceil(M / (M // cluster_size)) - 1``
===============  ==============================================================  =====================================

Clustered: clients are shuffled and split by ``np.array_split`` into
``M // cluster_size`` cliques whose sizes differ by at most one, so every clique
has at least ``cluster_size`` members: the remainder ``M % cluster_size`` is
spread over the cliques (sizes ``floor`` / ``ceil`` of ``M / (M // cluster_size)``).
Each client's neighbours are the other members of its clique.

Erdős–Rényi: the degree of a client is ``Binomial(M - 1, p)``; ``k_max`` is the
smallest ``k`` with ``M * P(Binomial(M - 1, p) > k) < 1e-6`` -- by the union
bound, a drawn graph exceeds it with probability below one in a million, so
rounds keep one shape. A graph that does exceed ``k_max`` raises a
``ValueError`` naming the round (it is never truncated); a run whose config
chooses ``k_max`` draws all its rounds' graphs before it starts, so a bound too
small for a later round is an error before any work. Its padded slots are what
an NTK round costs: a chosen bound near the drawn graphs' largest degree (15
over the first 30 rounds of ``M = 300``, mean degree 5, seed 0, against the
derived 22) makes every neighbourhood block smaller. NTK-DFL's round does not pad every
client to ``k_max`` when it maps clients in chunks: :func:`degree_slot_groups` gives each client the
fewest slots of a short ladder that hold its degree. Isolated clients are possible (an all-``False``
mask row).

Mixing weights (``MIXING_SCHEMES``): each client's new value is
``self_weight[i] * v_i + sum_k neighbor_weights[i, k] * v_{neighbors[i, k]}``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple
from collections.abc import Callable, Mapping

import chex
import networkx as nx
import numpy as np
from scipy import stats

from ntk_fl import validation

from ntk_fl.rng import Stream, numpy_rng

__all__ = [
  "Graph",
  "Topology",
  "TOPOLOGIES",
  "MIXING_SCHEMES",
  "make_topology",
  "topology_from_fields",
  "degree_slot_groups",
  "graph_from_networkx",
  "graph_to_networkx",
  "degrees",
  "mixing_weights",
  "mixing_matrix",
  "slem",
  "spectral_gap",
  "squared_spectral_gap",
]

TOPOLOGIES = ("regular", "erdos_renyi", "ring", "line", "complete", "clustered")
MIXING_SCHEMES = ("uniform", "data_size", "metropolis")

# Union-bound failure probability allowed for the Erdős–Rényi neighbour-slot bound.
_ER_OVERFLOW_PROB = 1e-6


class Graph(NamedTuple):
  """An undirected graph as a padded adjacency list (a pytree of two arrays).

  Attributes:
    neighbors: int32 ``[M, k_max]``; row ``i`` holds ``i``'s neighbours in
      ascending order followed by padding slots equal to ``i``.
    mask: bool ``[M, k_max]``; ``True`` where ``neighbors`` is a real neighbour.
  """

  neighbors: np.ndarray
  mask: np.ndarray


class Topology(NamedTuple):
  """A (possibly time-varying) communication graph over ``num_clients`` clients.

  Attributes:
    name: one of :data:`TOPOLOGIES`.
    num_clients: ``M``.
    k_max: neighbour slots of every sampled :class:`Graph`.
    dynamic: whether :attr:`sample` re-draws the graph every round.
    sample: ``sample(round) -> Graph``, deterministic in ``(seed, round)``.
    cliques: how many disjoint cliques every sampled graph consists of (the
      ``clustered`` family: every closed neighbourhood is a whole clique); 0 for
      the other families.
    slot_groups: the neighbour-slot counts a degree-grouped NTK round gives
      neighbourhoods (:func:`degree_slot_groups`); ``()`` = ``(k_max,)``.
  """

  name: str
  num_clients: int
  k_max: int
  dynamic: bool
  sample: Callable[[int], Graph]
  cliques: int = 0
  slot_groups: tuple[int, ...] = ()

  def client_slots(self, graph: Graph) -> np.ndarray:
    """int ``[M]``: the neighbour slots each client of ``graph`` (one of this topology's draws) takes in a
    degree-grouped round, the first of :func:`degree_slot_groups` that holds its degree."""
    groups = np.asarray(degree_slot_groups(self))
    return groups[np.searchsorted(groups, np.asarray(graph.mask).sum(axis=1))]


# --------------------------------------------------------------------------- graphs


def graph_from_networkx(
  g: nx.Graph, k_max: int, *, num_clients: int | None = None, round: int | None = None
) -> Graph:
  """Pads an undirected networkx graph on nodes ``0..M-1`` into a :class:`Graph`.

  Args:
    g: undirected graph; nodes must be the integers ``0..M-1``; no self loops.
    k_max: neighbour slots; a node of larger degree raises ``ValueError``.
    num_clients: ``M`` (default: ``g.number_of_nodes()``).
    round: only used to name the round in error messages.

  Returns:
    ``Graph(neighbors [M, k_max] int32, mask [M, k_max] bool)``.
  """
  m = g.number_of_nodes() if num_clients is None else num_clients
  if g.is_directed():
    raise ValueError("graph_from_networkx needs an undirected graph")
  if set(g.nodes) != set(range(m)):
    raise ValueError(f"graph nodes must be exactly 0..{m - 1}")
  if nx.number_of_selfloops(g):
    raise ValueError("graph has self loops; a client is never its own neighbour")
  edges = np.asarray(list(g.edges), dtype=np.int64).reshape(-1, 2)
  # Both directions of every edge, sorted by (source, target): the rank of an
  # entry within its source's run is its slot in the padded row.
  src = np.concatenate([edges[:, 0], edges[:, 1]])
  dst = np.concatenate([edges[:, 1], edges[:, 0]])
  order = np.lexsort((dst, src))
  src, dst = src[order], dst[order]
  deg = np.bincount(src, minlength=m)
  if deg.size and deg.max() > k_max:
    where = "" if round is None else f"round {round}: "
    raise ValueError(
      f"{where}drawn graph has a client of degree {int(deg.max())} > k_max={k_max}; "
      "pass a larger k_max (neighbour lists are never truncated)"
    )
  slot = np.arange(src.size) - (np.cumsum(deg) - deg)[src]
  neighbors = np.repeat(np.arange(m, dtype=np.int32)[:, None], k_max, axis=1)
  mask = np.zeros((m, k_max), dtype=bool)
  neighbors[src, slot] = dst
  mask[src, slot] = True
  chex.assert_shape([neighbors, mask], (m, k_max))
  return Graph(neighbors=neighbors, mask=mask)


def graph_to_networkx(graph: Graph) -> nx.Graph:
  """The undirected networkx graph of a :class:`Graph` (padding dropped)."""
  neighbors, mask = np.asarray(graph.neighbors), np.asarray(graph.mask)
  g = nx.Graph()
  g.add_nodes_from(range(neighbors.shape[0]))
  rows = np.nonzero(mask)[0]
  g.add_edges_from(zip(rows.tolist(), neighbors[mask].tolist()))
  return g


def degrees(graph: Graph) -> np.ndarray:
  """Number of real neighbours per client, int32 ``[M]``."""
  return np.asarray(graph.mask).sum(axis=1).astype(np.int32)


# ------------------------------------------------------------------- generators
# Each generator maps (num_clients, rng) to a networkx graph on nodes 0..M-1.


def _nx_seed(rng: np.random.Generator) -> int:
  # networkx generators take an integer seed; derive it from the round's stream.
  return int(rng.integers(2**31 - 1))


def _regular(degree: int) -> Callable[[int, np.random.Generator], nx.Graph]:
  return lambda m, rng: nx.random_regular_graph(degree, m, seed=_nx_seed(rng))


def _erdos_renyi(p: float) -> Callable[[int, np.random.Generator], nx.Graph]:
  # fast_gnp is O(M + edges) -- the plain G(n, p) generator loops over all M^2 pairs.
  return lambda m, rng: nx.fast_gnp_random_graph(m, p, seed=_nx_seed(rng))


def _ring(m: int, rng: np.random.Generator) -> nx.Graph:
  return nx.cycle_graph(rng.permutation(m).tolist())


def _line(m: int, rng: np.random.Generator) -> nx.Graph:
  return nx.path_graph(rng.permutation(m).tolist())


def _complete(m: int, rng: np.random.Generator) -> nx.Graph:
  del rng  # the complete graph is the same for every draw
  return nx.complete_graph(m)


def _clustered(cluster_size: int) -> Callable[[int, np.random.Generator], nx.Graph]:
  def generate(m: int, rng: np.random.Generator) -> nx.Graph:
    g = nx.empty_graph(m)
    for clique in np.array_split(rng.permutation(m), m // cluster_size):
      g.add_edges_from(itertools.combinations(clique.tolist(), 2))
    return g

  return generate


def _erdos_renyi_k_max(m: int, p: float) -> int:
  """Smallest ``k`` with ``M * P(Binomial(M - 1, p) > k) < 1e-6`` (union bound on the max degree)."""
  ks = np.arange(m)
  tail = stats.binom.sf(ks, m - 1, p)  # P(deg > k); exactly 0 at k = M - 1
  return int(ks[np.argmax(m * tail < _ER_OVERFLOW_PROB)])


# ------------------------------------------------------------------- factories


_check_int = validation.check_int


def _erdos_renyi_p(m: int, p: float, mean_degree: float) -> float:
  if (p > 0) == (mean_degree > 0):
    raise ValueError(
      f"erdos_renyi needs exactly one of p > 0 or mean_degree > 0 (the other 0), "
      f"got p={p}, mean_degree={mean_degree}"
    )
  if p < 0 or mean_degree < 0:
    raise ValueError(f"p and mean_degree must be >= 0, got p={p}, mean_degree={mean_degree}")
  if mean_degree > 0:
    if mean_degree > m - 1:
      raise ValueError(f"mean_degree must be <= num_clients - 1 = {m - 1}, got {mean_degree}")
    p = mean_degree / (m - 1)
  if p > 1:
    raise ValueError(f"p must be in (0, 1], got {p}")
  return float(p)


def make_topology(
  name: str,
  num_clients: int,
  *,
  seed: int,
  degree: int = 5,
  p: float = 0.0,
  mean_degree: float = 0.0,
  cluster_size: int = 6,
  dynamic: bool = True,
  k_max: int = 0,
) -> Topology:
  """Builds a topology; every argument is validated here, before any graph is drawn.

  Args:
    name: one of :data:`TOPOLOGIES`.
    num_clients: ``M``.
    seed: non-negative base seed; round ``r`` draws from ``SeedSequence([seed, Stream.TOPOLOGY, r])``.
    degree: neighbours per client for ``regular`` (``1 <= degree < M``, ``M*degree`` even).
    p: edge probability for ``erdos_renyi`` (set exactly one of ``p``, ``mean_degree``).
    mean_degree: expected degree for ``erdos_renyi``; ``p = mean_degree / (M - 1)``.
    cluster_size: minimum clique size for ``clustered`` (``2 <= cluster_size <= M``).
    dynamic: re-draw every round; otherwise every round returns the round-0 graph.
    k_max: neighbour slots; ``0`` derives the bound from the topology (module docstring).

  Returns:
    A :class:`Topology`. Parameters that do not apply to ``name`` are ignored.
  """
  if name not in TOPOLOGIES:
    raise ValueError(f"unknown topology {name!r}; choose one of {TOPOLOGIES}")
  m = _check_int("num_clients", num_clients, 2)
  seed = _check_int("seed", seed, 0)
  k_max = _check_int("k_max", k_max, 0)
  if not isinstance(dynamic, (bool, np.bool_)):
    raise ValueError(
      f"dynamic must be a bool (re-draw the graph every round or not), got {dynamic!r}"
    )
  dynamic = bool(dynamic)

  cliques = 0
  if name == "regular":
    degree = _check_int("degree", degree, 1, m - 1)
    if (m * degree) % 2:
      raise ValueError(
        f"a {degree}-regular graph on {m} clients needs num_clients * degree even, "
        f"got {m} * {degree} = {m * degree}"
      )
    generate, max_degree = _regular(degree), degree
  elif name == "erdos_renyi":
    prob = _erdos_renyi_p(m, p, mean_degree)
    generate, max_degree = _erdos_renyi(prob), None  # random: checked on every draw
  elif name == "ring":
    if m < 3:
      raise ValueError(f"a ring needs num_clients >= 3, got {m}")
    generate, max_degree = _ring, 2
  elif name == "line":
    generate, max_degree = _line, min(2, m - 1)
  elif name == "complete":
    generate, max_degree = _complete, m - 1
  else:  # clustered
    cluster_size = _check_int("cluster_size", cluster_size, 2, m)
    generate = _clustered(cluster_size)
    cliques = m // cluster_size
    max_degree = math.ceil(m / cliques) - 1  # largest clique after array_split

  if max_degree is None:
    derived = _erdos_renyi_k_max(m, prob)
  else:
    derived = max_degree
    # The maximum degree is attained by every draw: a smaller k_max can never work.
    if 0 < k_max < max_degree:
      raise ValueError(
        f"k_max={k_max} is below the degree {max_degree} that every {name!r} graph "
        f"on {m} clients reaches; use k_max=0 (derive) or >= {max_degree}"
      )
  slots = k_max or derived

  def draw(round_: int) -> Graph:
    rng = numpy_rng(seed, Stream.TOPOLOGY, round_)
    return graph_from_networkx(generate(m, rng), slots, num_clients=m, round=round_)

  def sample(round: int) -> Graph:  # noqa: A002 -- the contract's argument name
    r = _check_int("round", round, 0)
    return draw(r if dynamic else 0)

  return Topology(
    name=name,
    num_clients=m,
    k_max=slots,
    dynamic=dynamic,
    sample=sample,
    cliques=cliques,
    slot_groups=_slot_ladder(name, slots),
  )


# The graph arguments of make_topology that a config's ``topology`` fields name.
_GRAPH_FIELDS = ("degree", "p", "mean_degree", "cluster_size", "dynamic", "k_max")
# Consecutive neighbour-slot groups of degree_slot_groups grow by this factor: a client runs at most
# this many times its degree's slots (plus one), and each group compiles the client update once more.
_SLOT_GROWTH = 1.4
_SPREAD_DEGREES = ("erdos_renyi",)  # the families whose clients' degrees spread below k_max


def topology_from_fields(fields: Mapping[str, Any], num_clients: int, *, seed: int) -> Topology:
  """:func:`make_topology` from a config's ``topology`` fields (a stored config's dict or its settings).

  Fields ``make_topology`` does not take (``mixing``) are ignored and absent ones take its defaults,
  so a config stored before a field existed builds the graph it ran on.
  """
  graph = {key: fields[key] for key in _GRAPH_FIELDS if key in fields}
  return make_topology(fields["name"], num_clients, seed=seed, **graph)


def degree_slot_groups(graphs: Topology) -> tuple[int, ...]:
  """The neighbour-slot counts a degree-grouped round gives neighbourhoods, ascending, ending at ``k_max``.

  ``(k_max,)`` for a family whose clients all reach (about) the same degree; for Erdős–Rényi
  ``2, 3, 5, 7, 10, 14, 20, ...`` (each about :data:`_SLOT_GROWTH` times the last) up to ``k_max``
  (:attr:`Topology.slot_groups`): a client of degree ``d`` gets the first count ``>= d``. The NTK work
  of a neighbourhood grows with the square of its samples, so at 300 clients of mean degree 5
  (``k_max`` 22) a round does about a tenth of the work of one that pads every client to ``k_max``.
  """
  return tuple(graphs.slot_groups) or (graphs.k_max,)


def _slot_ladder(name: str, k_max: int) -> tuple[int, ...]:
  """:attr:`Topology.slot_groups` of the family ``name`` with ``k_max`` slots."""
  if name not in _SPREAD_DEGREES or k_max <= 2:
    return (k_max,)
  groups = [2]
  while math.ceil(groups[-1] * _SLOT_GROWTH) < k_max:
    groups.append(max(groups[-1] + 1, math.ceil(groups[-1] * _SLOT_GROWTH)))
  return (*groups, k_max)


# -------------------------------------------------------------- mixing weights


def _check_scheme(scheme: str) -> None:
  if scheme not in MIXING_SCHEMES:
    raise ValueError(f"unknown mixing scheme {scheme!r}; choose one of {MIXING_SCHEMES}")


def _check_sizes(sizes: Any, m: int) -> np.ndarray:
  if sizes is None:
    raise ValueError("mixing scheme 'data_size' needs sizes [M] (samples per client)")
  sizes = np.asarray(sizes, dtype=np.float64)
  if sizes.shape != (m,):
    raise ValueError(f"sizes must have shape ({m},), got {sizes.shape}")
  if not np.all(np.isfinite(sizes)) or np.any(sizes < 0):
    raise ValueError(f"sizes must be finite and >= 0, got min {sizes.min()}")
  return sizes


def mixing_weights(
  graph: Graph, scheme: str = "uniform", sizes: Any = None
) -> tuple[np.ndarray, np.ndarray]:
  """Per-client gossip weights on a padded graph (host-side, numpy).

  Schemes:

  * ``uniform``: every member of the closed neighbourhood gets ``1 / (deg_i + 1)``
    (the authors' code). Symmetric -- hence doubly stochastic -- only on regular graphs.
  * ``data_size``: NTK-DFL eq. 1, ``w_ij = N_j / (N_i + sum_{j in N(i)} N_j)``.
  * ``metropolis``: Metropolis–Hastings, ``w_ij = 1 / (1 + max(deg_i, deg_j))``,
    ``w_ii = 1 - sum_j w_ij``; symmetric and doubly stochastic on any graph.

  Args:
    graph: a :class:`Graph` with ``M`` clients and ``k_max`` slots.
    scheme: one of :data:`MIXING_SCHEMES`.
    sizes: ``[M]`` non-negative sample counts; required by ``data_size`` only.

  Returns:
    ``(self_weight [M], neighbor_weights [M, k_max])``, float32; padded slots are
    0 and every row (self + neighbours) sums to 1.
  """
  _check_scheme(scheme)
  neighbors, mask = np.asarray(graph.neighbors), np.asarray(graph.mask)
  chex.assert_rank(neighbors, 2)
  chex.assert_equal_shape([neighbors, mask])
  chex.assert_type([neighbors, mask], [int, bool])
  m = neighbors.shape[0]
  deg = mask.sum(axis=1)
  if scheme == "uniform":
    self_w = 1.0 / (deg + 1.0)
    nbr_w = mask * self_w[:, None]
  elif scheme == "data_size":
    sizes = _check_sizes(sizes, m)
    nbr_sizes = np.where(mask, sizes[neighbors], 0.0)
    total = sizes + nbr_sizes.sum(axis=1)
    if np.any(total <= 0):
      bad = int(np.argmax(total <= 0))
      raise ValueError(
        f"client {bad} and its neighbours hold 0 samples; data_size weights undefined"
      )
    self_w = sizes / total
    nbr_w = nbr_sizes / total[:, None]
  else:  # metropolis
    nbr_w = np.where(mask, 1.0 / (1.0 + np.maximum(deg[:, None], deg[neighbors])), 0.0)
    self_w = 1.0 - nbr_w.sum(axis=1)
  return self_w.astype(np.float32), nbr_w.astype(np.float32)


def mixing_matrix(graph: Graph, scheme: str = "uniform", sizes: Any = None) -> np.ndarray:
  """Dense ``[M, M]`` float32 mixing matrix ``W`` of :func:`mixing_weights`.

  ``W[i, i] = self_weight[i]``, ``W[i, neighbors[i, k]] = neighbor_weights[i, k]``;
  rows sum to 1, so ``W @ v`` is one gossip step on stacked client values ``v [M, ...]``.
  """
  self_w, nbr_w = mixing_weights(graph, scheme, sizes)
  neighbors = np.asarray(graph.neighbors)
  m = neighbors.shape[0]
  w = np.diag(self_w.astype(np.float64))
  # Padded slots point at the client itself with weight 0, so scattering every
  # slot (unbuffered add: padding repeats the diagonal index) needs no mask.
  np.add.at(w, (np.repeat(np.arange(m), neighbors.shape[1]), neighbors.ravel()), nbr_w.ravel())
  return w.astype(np.float32)


# ---------------------------------------------------------------- spectral gap


def slem(w: Any, *, atol: float = 1e-5) -> float:
  """Second largest eigenvalue modulus ``lambda = max(|lambda_2|, |lambda_M|)``.

  For a symmetric, doubly stochastic ``W`` with eigenvalues
  ``1 = lambda_1 >= lambda_2 >= ... >= lambda_M`` (NTK-DFL Def. 4.2). It is the
  per-step contraction factor of gossip: ``||W^k - 11^T/M||_op = lambda^k``.
  Computed in float64; ``atol`` bounds the allowed asymmetry / row-sum error.
  """
  w = np.asarray(w, dtype=np.float64)
  if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 2:
    raise ValueError(f"W must be a square [M, M] matrix with M >= 2, got shape {w.shape}")
  if not np.allclose(w, w.T, rtol=0.0, atol=atol):
    raise ValueError(
      "W must be symmetric (eigenvalues real); use scheme='metropolis' on non-regular graphs"
    )
  if not np.allclose(w.sum(axis=1), 1.0, rtol=0.0, atol=atol):
    raise ValueError("W must be (doubly) stochastic: rows must sum to 1")
  eig = np.linalg.eigvalsh(w)  # ascending: eig[-1] = lambda_1 = 1
  # |eigenvalues| of a stochastic matrix are <= 1; clip the rounding excess of a
  # float32 W (a disconnected graph has lambda_2 = 1 up to ~1e-7).
  return float(min(max(abs(eig[-2]), abs(eig[0])), 1.0))


def spectral_gap(w: Any, *, atol: float = 1e-5) -> float:
  """``1 - lambda`` with ``lambda`` = :func:`slem` (``W`` symmetric, doubly stochastic).

  1 for the complete graph with uniform weights (one step reaches consensus),
  near 0 for sparse graphs with slow mixing (a ring: ``O(1/M^2)``), 0 when disconnected.
  """
  return 1.0 - slem(w, atol=atol)


def squared_spectral_gap(w: Any, *, atol: float = 1e-5) -> float:
  """NTK-DFL Def. 4.2's "spectral gap" ``(1 - lambda)^2``, the quantity in its bounds (9c)."""
  return spectral_gap(w, atol=atol) ** 2
