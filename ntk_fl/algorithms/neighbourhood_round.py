"""The round of the neighbourhood-NTK methods: NTK-DFL (:mod:`ntk_fl.algorithms.ntk_dfl`) and SPARK.

:func:`make_neighbourhood_round` builds what a round of both shares: the round's graph and mixing weights
(:func:`~ntk_fl.algorithms.graph_inputs.graph_round_inputs`), the per-round averaging of the round-start
weights (NTK-DFL eq. 1), the sub-sampling of every client's samples (App. E.2) and the gathering of each
client's neighbourhood data into ``m1`` blocks (App. E.1), then maps the method's client function over the
clients with :func:`ntk_fl.parallel.for_each_client`. It knows nothing of the NTK step: the client
function (NTK-DFL's :func:`~ntk_fl.algorithms.ntk_dfl.make_client_update`, SPARK's sketched update) is an
argument. :mod:`ntk_fl.algorithms.ntk_dfl` re-exports both names.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import gossip, models, parallel, rng, topology
from ntk_fl.algorithms.graph_inputs import graph_round_inputs

__all__ = ["NeighbourhoodRound", "make_neighbourhood_round"]


def _subsample_indices(key, mask, num_keep, divisor):
  """Random subset of each client's real samples, compacted to ``num_keep`` slots.

  Args:
    key: PRNG key of the round.
    mask: bool ``[M, n_max]`` real-sample mask.
    num_keep: static slot count ``ceil(n_max / m2)``.
    divisor: the subsampling divisor ``m2``.

  Returns:
    ``(indices [M, num_keep], keep_mask [M, num_keep])``: client ``i`` keeps
    ``⌊n_i / m2⌋`` (at least 1) uniformly drawn real samples; the other slots are
    masked padding.
  """
  order = rng.masked_permutation(key, mask)[:, :num_keep]
  n_real = mask.sum(axis=1)
  n_keep = jnp.maximum(jnp.floor(n_real / divisor), 1).astype(jnp.int32)
  keep_mask = jnp.arange(num_keep)[None, :] < n_keep[:, None]
  return order, keep_mask


class NeighbourhoodRound(NamedTuple):
  """The reusable core of an NTK-DFL round (SPARK builds on it).

  Attributes:
    data: the federation on device (:class:`ntk_fl.data.Federation`: one copy of
      the samples, ``index``/``mask [M, n]``); pass it to ``run`` as an argument
      (never bake it into a jitted program).
    samples_sent: numpy int ``[M]``, the samples each client's package covers in a
      round: ``n_i``, or ``max(⌊n_i/m2⌋, 1)`` when sub-sampling (static).
    round_inputs: ``round_inputs(r) -> GraphRound`` (graph, mixing weights, key of round ``r``).
    run: ``run(params, inputs, data, client_fn, *client_args) -> (outputs, lr)``, to be
      called inside the caller's ``jit``: averages the round-start weights (when
      enabled), sub-samples, computes the round's ``lr`` and maps
      ``client_fn(w̄_i, x [m1, N_b, ...], targets [m1, N_b, C], mask [m1, N_b], lr, *client_args_i)``
      over the clients with :func:`ntk_fl.parallel.for_each_client` (``client_args``
      leaves carry a leading client axis). ``targets`` are the hard one-hot labels of
      client ``i``'s neighbourhood (own samples first); ``outputs`` are stacked ``[M, ...]``.
      Built with ``share_cliques=True``, ``client_fn`` runs once per clique (on its
      lowest-numbered member) and every member receives that output; ``client_args``
      must then be empty (a member's own state would be ignored).
  """

  data: Any
  samples_sent: Any
  round_inputs: Any
  run: Any


def make_neighbourhood_round(
  model: models.Model,
  federation,
  graphs: topology.Topology,
  *,
  seed: int,
  lr: float,
  lr_decay: float,
  per_round_averaging: bool,
  mixing: str = "uniform",
  jacobian_batches: int = 1,
  subsample: int = 1,
  share_cliques: bool = False,
  group_by_degree: bool = False,
) -> NeighbourhoodRound:
  """Builds the parts of an NTK-DFL round shared by every neighbourhood-NTK method.

  Clients are mapped with :func:`ntk_fl.parallel.for_each_client` under the
  device policy in force when ``run`` is traced (:func:`ntk_fl.parallel.use_devices`).

  Args:
    model: the model (its ``num_classes``).
    federation: a :class:`ntk_fl.data.Federation` of ``M`` clients.
    graphs: the communication :class:`ntk_fl.topology.Topology` over the ``M`` clients.
    seed: the run seed (round keys; the graphs draw from their own).
    mixing: mixing scheme of the per-round averaging (:data:`ntk_fl.topology.MIXING_SCHEMES`).
    lr, lr_decay: round ``r`` (0-based) uses ``lr·exp(−lr_decay·r)``.
    per_round_averaging: average the round-start weights over each closed neighbourhood (eq. 1).
    jacobian_batches: ``m1`` blocks of the neighbourhood data (App. E.1).
    subsample: ``m2``, each client uses a random ``⌊n_i/m2⌋`` of its samples per round (App. E.2).
    share_cliques: on a topology of disjoint cliques (``graphs.cliques > 0``, the
      ``clustered`` family) with per-round averaging, every member of a clique
      holds the same ``w̄`` and the same neighbourhood data (in another order), so
      its client function is the same up to float summation order: compute it
      once per clique (SPARK App. A.2: "each device computes one Jacobian reused
      by all neighbours"), clique-size times less work. Needs ``per_round_averaging``.
    group_by_degree: on a topology whose clients' degrees spread (Erdős–Rényi), give each client's
      neighbourhood the fewest neighbour slots of :func:`ntk_fl.topology.degree_slot_groups` that hold
      its degree this round instead of all ``k_max`` (:func:`ntk_fl.parallel.for_each_client_by_group`),
      when clients are mapped in chunks. Only for a ``client_fn`` whose work does not depend on the slot
      count (the ``any_slot_count`` of NTK-DFL's and SPARK's hyperparameters: padded slots are masked
      samples, so the result is the same up to float rounding); elsewhere every neighbourhood keeps
      ``k_max`` slots.
  """
  if graphs is None:
    raise ValueError(
      "a neighbourhood round needs a communication topology but got none: register the "
      "method's Method with graph=True (the schema then builds config.topology)"
    )
  num_clients, n_max = federation.mask.shape
  num_classes = model.num_classes
  m1, m2 = int(jacobian_batches), int(subsample)
  n_sub = -(-n_max // m2)  # ceil: static slots per client after subsampling
  n_sub_padded = -(-n_sub // m1) * m1  # each member's slots split evenly into m1 blocks
  if m1 > n_sub:
    raise ValueError(
      f"config.algorithm.jacobian_batches={m1} exceeds the {n_sub} data slots per client "
      f"(n_max={n_max}, subsample={m2}): some blocks would hold no data"
    )

  if graphs.num_clients != num_clients:
    raise ValueError(
      f"the topology spans {graphs.num_clients} clients, the federation {num_clients}"
    )
  if share_cliques and (not graphs.cliques or not per_round_averaging):
    raise ValueError(
      "sharing one client update per clique needs topology.name='clustered' and per-round "
      f"averaging (got topology {graphs.name!r}, per_round_averaging={per_round_averaging}): "
      "only then do the members of a closed neighbourhood hold the same averaged weights"
    )
  sizes = np.asarray(federation.n)
  # A federation whose samples are split over the devices (a multi-process run, each process holding only
  # its clients' samples): neighbours' samples and weights are fetched from their devices (parallel.Shared).
  split = parallel.is_client_split(federation.samples_x)
  data = parallel.to_device(federation)
  round_inputs = graph_round_inputs(graphs, mixing, sizes, seed)
  slot_groups = topology.degree_slot_groups(graphs) if group_by_degree else (graphs.k_max,)

  def neighbourhood(idx, nbrs, nbr_mask, samples, rows, ms):
    """Gathers client ``idx``'s and its neighbours' (sub-sampled) data into ``m1`` blocks.

    ``rows``/``ms`` ``[M, n]`` are every client's sample rows (into ``data``) and mask
    this round; only the ``k+1`` members' samples are gathered, so memory follows
    the chunk of clients being processed, not ``M``.
    """
    members = jnp.concatenate([idx[None], nbrs])  # [k+1]
    member_mask = jnp.concatenate([jnp.ones((1,), bool), nbr_mask])
    x, y = samples.take(rows[members])  # [k+1, n, ...]
    mask = ms[members] & member_mask[:, None]

    def blocks(a):  # [k+1, nb*m1, ...] -> [m1, (k+1)*nb, ...]
      # Strided, not contiguous: real samples come first in every member's slots, so slot s goes to block
      # s mod m1 and each block gets ≈ n_j/m1 real samples of every member j.
      a = a.reshape(a.shape[0], a.shape[1] // m1, m1, *a.shape[2:])
      a = jnp.moveaxis(a, 2, 0)
      return a.reshape(m1, -1, *a.shape[3:])

    targets = jax.nn.one_hot(y, num_classes, dtype=jnp.float32)
    return blocks(x), blocks(targets), blocks(mask)

  def run(params, inputs, data, client_fn, *client_args):
    rows, ms = data.index, data.mask
    if m2 > 1:
      idx, keep = _subsample_indices(inputs.key, ms, n_sub, m2)
      rows = jnp.take_along_axis(rows, idx, axis=1)
      ms = keep
    if n_sub_padded != rows.shape[1]:
      pad = n_sub_padded - rows.shape[1]
      zero_row = data.samples_y.shape[0] - 1  # the federation's all-zero sample
      rows = jnp.pad(rows, [(0, 0), (0, pad)], constant_values=zero_row)
      ms = jnp.pad(ms, [(0, 0), (0, pad)])
    round_lr = lr * jnp.exp(-lr_decay * inputs.round.astype(jnp.float32))

    def per_client(slots, stacked, samples, p, idx, nbrs, nbr_mask, self_w, nbr_w, *args):
      if per_round_averaging:
        # w̄_i (eq. 1) from the round-start state shared whole: formed per chunk, so the round holds
        # the state it starts from and the one it returns, never an [M, ...] copy of the averages.
        p = gossip.mix_one(stacked, p, nbrs, self_w, nbr_w)
      # Real neighbours come first in a row, so the first `slots` hold all of them.
      x, t, m = neighbourhood(idx, nbrs[:slots], nbr_mask[:slots], samples, rows, ms)
      return client_fn(p, x, t, m, round_lr, *args)

    shared = (
      parallel.Shared(params, split),
      parallel.Shared((data.samples_x, data.samples_y), split),
    )
    update = functools.partial(
      parallel.for_each_client(functools.partial(per_client, graphs.k_max)), *shared
    )
    clients = jnp.arange(num_clients)
    weights = (inputs.self_weight, inputs.neighbor_weights)
    if not share_cliques:
      if len(slot_groups) > 1:
        # The group of a client: the first slot count that holds its degree this round.
        group = jnp.searchsorted(jnp.asarray(slot_groups), inputs.neighbor_mask.sum(axis=1))
        fns = [functools.partial(per_client, slots) for slots in slot_groups]
        update = functools.partial(parallel.for_each_client_by_group(fns), group, *shared)
      return update(
        params, clients, inputs.neighbors, inputs.neighbor_mask, *weights, *client_args
      ), round_lr
    if client_args:
      raise ValueError(
        "share_cliques=True runs client_fn once per clique, so it takes no per-client arguments"
      )
    # A clique's representative is its lowest-numbered member (padding slots hold the client's own index).
    representative = jnp.minimum(clients, inputs.neighbors.min(axis=1))
    leaders = jnp.unique(representative, size=graphs.cliques)
    outputs = update(
      jax.tree.map(lambda p: p[leaders], params),
      leaders,
      inputs.neighbors[leaders],
      inputs.neighbor_mask[leaders],
      *(w[leaders] for w in weights),
    )
    slot = jnp.searchsorted(leaders, representative)
    return jax.tree.map(lambda o: o[slot], outputs), round_lr

  samples_sent = np.maximum(sizes // m2, 1) if m2 > 1 else sizes
  return NeighbourhoodRound(
    data=data, samples_sent=samples_sent, round_inputs=round_inputs, run=run
  )
