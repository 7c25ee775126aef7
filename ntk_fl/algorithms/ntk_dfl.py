"""NTK-DFL (Thompson, Yue, Wong, Dai; ICML 2025): decentralized NTK-based federated learning.

One synchronous round ``r`` (paper Sec. 3.2 and App. A, Alg. 1-4):

1. **Graph.** ``round_inputs(r)`` draws the round's graph (deterministic in the
   config seed and ``r``) and its mixing weights.
2. **Per-round averaging** (eq. 1): ``w̄_i = s_i w_i + Σ_k a_ik w_{n_ik}`` from the
   round-start weights of all clients (data-size weights by default, uniform
   when the sizes are equal -- see ``config.topology.mixing``).
3. **Neighbourhood NTK evolution.** Client ``i`` stacks its own and its
   neighbours' data and evaluates every Jacobian at *its own* averaged weights
   ``w̄_i`` (a single linearisation point, as in the paper and the authors'
   code), evolves the function values with the ``τ`` grid and keeps the ``τ``
   whose non-linear network ``w̄_i + Δw_τ`` has the lowest cross-entropy on the
   neighbourhood data (:func:`ntk_fl.evolve.ntk_step`).
4. **Synchronous update** ``w_i ← w̄_i + Δw_{τ*}`` for all clients at once.

The learning rate of round ``r`` (0-based) is ``η·exp(−decay·r)`` (authors' code;
0.07 in the reference; the paper itself states a constant 0.01).

Options studied in the paper (all in ``config.algorithm``):

* ``per_round_averaging=False`` -- the Fig. 7 ablation: no averaging; client
  ``i`` evolves from its own weights (neighbours' data still evaluated at the
  receiver's weights, so each kernel keeps one linearisation point).
* ``jacobian_batches=m1`` -- Jacobian batching (App. E.1): the neighbourhood data
  are split into ``m1`` blocks (every member's samples dealt round-robin, so each
  block holds ≈ ``1/m1`` of every member's data); the blocks are evolved one after another, each starting from the
  current (already updated) network outputs, all linearised at ``w̄_i`` (the
  block-diagonal of the full kernel, as the authors' development code did), with
  a ``τ`` selection per block.
* ``subsample=m2`` -- data subsampling (App. E.2): each round every client uses a
  random ``⌊n_i/m2⌋`` of its samples (redrawn every round from the round key; the
  same subset is sent to all of its neighbours).
* Communication compression (App. E.3, Figs. 15-16), combinable with each
  other, with ``subsample`` and with the clustered topology:
  ``sparsify_keep`` -- each transmitted package (one sender's Jacobian rows of
  one parameter tensor, ``[n_j, C, *leaf]``) keeps its largest-magnitude
  fraction; ``quantize_bits`` -- its values are sent with ``b``-bit min-max
  quantisation (one range per package tensor); both by
  :func:`ntk_fl.compression.compress_packages`, the compression SPARK's packages
  use. A client's own rows are never sent and stay exact. Compressed
  Jacobians change the kernel, so the client then materialises its
  neighbourhood's Jacobian and builds kernel and update from the compressed
  one (``jacobian=`` of :func:`ntk_fl.evolve.ntk_step`); uncompressed rounds
  stay matrix-free. ``projection_dim`` = d1' -- the shared seeded input
  projection ``Z = X P`` of CP-NTK-FL (:func:`ntk_fl.jacobians.projection_matrix`):
  the clients train the same MLP on d1'-dimensional inputs (every Jacobian
  and weight message shrinks with the first layer) and ``client_params``
  folds ``P`` into the first layer, so the models are scored on raw inputs.
* Topology (regular / Erdős–Rényi / ring / line / complete / clustered, static or
  dynamic) and shared vs per-client initialisation come from ``config.topology``
  and ``config.model.init``. In a clustered topology every member of a clique
  holds the same averaged weights and neighbourhood, so the per-cluster Jacobian
  of the paper (App. E.2) is exactly what each member computes here.

Every client's chosen ``τ`` and selected loss are returned each round as
``[M]`` metrics (``tau``, ``loss``), with the communication: ``bits_sent``
``[M]`` (:func:`ntk_fl.communication.neighbourhood_round_bits`: weights to and
from each neighbour and one Jacobian package per neighbour, float32 or
compressed, :func:`ntk_fl.communication.jacobian_package_bits`),
``bits_sent_total`` and ``bits_cumulative``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import (
  communication,
  compression,
  gossip,
  jacobians,
  models,
  parallel,
  rng,
  topology,
  validation,
)
from ntk_fl.algorithms.base import Method
from ntk_fl._src import ntk_step
from ntk_fl._src.options import Kernel, Loss, Select, Solver, check_taus
from ntk_fl.algorithms.graph_inputs import graph_round_inputs
from ntk_fl.algorithms.base import (
  Algorithm,
  ClientFn,
  ParamsState,
  Replicable,
  ScoreFn,
  TargetsFn,
  check_evolution,
  config_without,
  run_options,
)
from ntk_fl.rng import Stream, jax_key
from ntk_fl.topology import Topology

__all__ = [
  "NTKDFLHParams",
  "NeighbourhoodRound",
  "make_client_update",
  "make_neighbourhood_round",
  "make_ntk_dfl",
  "METHOD",
]


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


@dataclasses.dataclass(frozen=True)
class NTKDFLHParams:
  """NTK-DFL (``config.algorithm``; every value checked on construction).

  Attributes:
    lr, lr_decay: round ``r`` (0-based) uses ``lr·exp(−lr_decay·r)``.
    taus, loss, solver, select, kernel: the neighbourhood NTK evolution
      (:func:`ntk_fl.algorithms.base.check_evolution`).
    per_round_averaging: average the round-start weights over each closed
      neighbourhood (eq. 1); False is the Fig. 7 ablation.
    jacobian_batches: ``m1`` blocks of the neighbourhood data (App. E.1; >= 1).
    subsample: ``m2``, each client uses a random ``⌊n_i/m2⌋`` of its samples per round (App. E.2; >= 1).
    sparsify_keep: top-k fraction of every sent package tensor in (0, 1] (App. E.3; 1 = dense).
    quantize_bits: 32 (float32) or [1, 16] bits per sent Jacobian value (App. E.3).
    projection_dim: d1' of the shared input projection ``Z = X P`` (App. E.3; 0 = none; MLP only).
    projection_scale: :data:`ntk_fl.jacobians.PROJECTION_SCALES`.
  """

  lr: float
  lr_decay: float
  taus: tuple[int, ...]
  loss: Loss
  solver: Solver
  select: Select
  kernel: Kernel
  per_round_averaging: bool
  jacobian_batches: int
  subsample: int
  # App. E.3 compression; the defaults are the uncompressed protocol (configs stored before these existed).
  sparsify_keep: float = 1.0
  quantize_bits: int = compression.FLOAT_BITS
  projection_dim: int = 0
  projection_scale: str = "sqrt_input"

  def __post_init__(self):
    check_evolution(self)
    for name in ("jacobian_batches", "subsample"):
      validation.check_int(f"config.algorithm.{name}", getattr(self, name), low=1)
    validation.check_bool("config.algorithm.per_round_averaging", self.per_round_averaging)
    validation.check_real(
      "config.algorithm.sparsify_keep (top-k fraction per package tensor; 1 = dense)",
      self.sparsify_keep,
      low=0,
      high=1,
      low_open=True,
    )
    if self.quantize_bits != compression.FLOAT_BITS:
      validation.check_int(
        "config.algorithm.quantize_bits (32 = float32, no quantisation)",
        self.quantize_bits,
        low=1,
        high=16,
      )
    validation.check_int(
      "config.algorithm.projection_dim (d1'; 0 = no projection)", self.projection_dim, low=0
    )
    validation.check_choice(
      "config.algorithm.projection_scale", self.projection_scale, jacobians.PROJECTION_SCALES
    )
    if self.compressed and self.jacobian_batches != 1:
      raise ValueError(
        "config.algorithm.sparsify_keep < 1 or quantize_bits < 32 compresses each sender's whole "
        f"package, which Jacobian batching splits over blocks: set jacobian_batches=1 (got "
        f"{self.jacobian_batches})"
      )

  @property
  def compressed(self) -> bool:
    """Whether the sent Jacobians are altered (so the client must materialise them)."""
    return self.sparsify_keep < 1 or self.quantize_bits != compression.FLOAT_BITS


def check(hparams: NTKDFLHParams, run) -> None:
  """Rules across blocks: the input projection needs the MLP."""
  if hparams.projection_dim and run.model.name != "mlp":
    raise ValueError(
      "config.algorithm.projection_dim projects flattened inputs into the first dense layer; it "
      f"needs model.name='mlp', got {run.model.name!r}"
    )


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

    def per_client(stacked, samples, p, idx, nbrs, nbr_mask, self_w, nbr_w, *args):
      if per_round_averaging:
        # w̄_i (eq. 1) from the round-start state shared whole: formed per chunk, so the round holds
        # the state it starts from and the one it returns, never an [M, ...] copy of the averages.
        p = gossip.mix_one(stacked, p, nbrs, self_w, nbr_w)
      x, t, m = neighbourhood(idx, nbrs, nbr_mask, samples, rows, ms)
      return client_fn(p, x, t, m, round_lr, *args)

    shared = (
      parallel.Shared(params, split),
      parallel.Shared((data.samples_x, data.samples_y), split),
    )
    update = functools.partial(parallel.for_each_client(per_client), *shared)
    clients = jnp.arange(num_clients)
    weights = (inputs.self_weight, inputs.neighbor_weights)
    if not share_cliques:
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


def make_client_update(
  model: models.Model,
  hparams: NTKDFLHParams,
  *,
  targets_fn: TargetsFn | None = None,
  score_fn: ScoreFn | None = None,
  neighbourhood_slots: int | None = None,
) -> ClientFn:
  """NTK-DFL's client update: one client's NTK evolution over its neighbourhood, every setting forwarded.

  The step (:func:`ntk_fl.evolve.ntk_step`) takes ``hparams``' ``taus``, ``loss``, ``solver``, ``select``
  and ``kernel`` and the model's dense stack; with ``jacobian_batches = m1 > 1`` the ``m1`` blocks are
  evolved one after another (App. E.1: every block linearised at ``w̄_i``, starting from the outputs of the
  already updated network, with its own ``τ``). A variant changes only what it names through the hooks.

  Args:
    model: the model (``apply``, ``dense_stack``).
    hparams: :class:`NTKDFLHParams` (its enum fields already members: the dataclass parses them).
    targets_fn: ``targets_fn(f0, hard) -> [N_b, C]``, the evolution targets of a block from its starting
      outputs ``f0 = f(start; x_b)`` and its hard one-hot labels ``hard``; default: ``hard``. The ``τ``
      candidates are always scored against ``hard`` (with ``select``).
    score_fn: ``score_fn(logits [N_b, C], hard [N_b, C], mask [N_b]) -> scalar``, the score of one ``τ``
      candidate's outputs on the block (:class:`~ntk_fl.algorithms.base.ScoreFn`: the candidate
      network's with ``select='network'``, the evolved ``f_τ`` with ``'linearized'``); the lowest wins.
      Default: the mean ``hparams.loss``, ``ntk_fl.evolve.mean_loss(logits, hard, mask, hparams.loss)``; the
      ``loss`` metric is the chosen candidate's score.
    neighbourhood_slots: ``1 + k_max``, the neighbourhood's slots of ``N_b / (1 + k_max)`` rows each (the
      client's own first): needed when ``hparams`` compresses the sent Jacobians (App. E.3), whose
      packages are per slot; the client's own rows are never sent, so never compressed.

  Returns:
    A :class:`ClientFn` for :meth:`NeighbourhoodRound.run`:
    ``client_update(w̄_i, x [m1, N_b, ...], hard [m1, N_b, C], mask [m1, N_b], lr) -> (w_i, info)``
    with ``info = {'tau', 'loss'}`` float32 scalars (the mean over blocks weighted by their real samples
    when ``m1 > 1``).
  """
  m1 = int(hparams.jacobian_batches)
  if hparams.compressed and neighbourhood_slots is None:
    raise ValueError(
      "a compressed NTK-DFL client update (sparsify_keep < 1, quantize_bits < 32) needs "
      "neighbourhood_slots = 1 + k_max: its Jacobian packages are per neighbourhood slot"
    )
  # The step's options, the τ grid checked once here rather than on every trace.
  options = dict(
    taus=check_taus(tuple(hparams.taus)),
    loss=hparams.loss,
    solver=hparams.solver,
    select=hparams.select,
    kernel=hparams.kernel,
    dense_stack=model.dense_stack,
    flax_apply=model.flax_apply,
    per_sample=model.per_sample,
  )
  keep, bits = float(hparams.sparsify_keep), int(hparams.quantize_bits)

  def step(params, x, hard, mask, lr, start, **explicit):
    targets = hard if targets_fn is None else functools.partial(_call_targets, targets_fn, hard)
    labels = None if targets_fn is None else hard
    return ntk_step.ntk_step(
      model.apply,
      params,
      x,
      targets,
      mask,
      lr=lr,
      labels=labels,
      start=start,
      score_outputs=score_fn,
      **options,
      **explicit,
    )

  def compressed_jacobian(
    params, x, mask
  ):  # x [N_b, ...]: the packages as the client receives them
    xs = jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
    leaves, treedef = jax.tree.flatten(jacobians.per_sample_jacobian(model.apply, params, xs))
    sent = (
      jnp.arange(neighbourhood_slots) > 0
    )  # the client's own rows (slot 0) are never transmitted
    leaves = compression.compress_packages(leaves, mask, neighbourhood_slots, keep, bits, sent=sent)
    return jax.tree.unflatten(treedef, leaves)

  def client_update(params, x, hard, mask, lr):
    if m1 == 1:
      explicit = {}
      if hparams.compressed:  # the kernel and the update from the compressed packages
        explicit["jacobian"] = compressed_jacobian(params, x[0], mask[0])
      delta, info = step(params, x[0], hard[0], mask[0], lr, None, **explicit)
      return jax.tree.map(jnp.add, params, delta), {"tau": info["tau"], "loss": info["loss"]}
    return _batched_update(step, params, x, hard, mask, lr)

  return client_update


def _call_targets(targets_fn, hard, f0):
  return targets_fn(f0, hard)


def make_ntk_dfl(
  model: models.Model,
  federation,
  topology: Topology | None,
  hparams: NTKDFLHParams,
  run=None,
  *,
  seed: int | None = None,
  mixing: str | None = None,
  shared_init: bool | None = None,
  targets_fn: TargetsFn | None = None,
  score_fn: ScoreFn | None = None,
) -> Algorithm:
  """Builds NTK-DFL for ``federation`` (a :class:`ntk_fl.data.Federation`) and ``model``.

  A :class:`ntk_fl.algorithms.MakeFn`: registered as is (``Method(make=make_ntk_dfl, ...)``). Without
  ``run`` settings (your own federation and topology), ``seed``, ``mixing`` and ``shared_init`` may be
  given as keywords instead (defaults 0, ``'uniform'``, True).

  Args:
    model: the model.
    federation: the stacked client data (``M`` clients).
    topology: the communication :class:`ntk_fl.topology.Topology` over the ``M`` clients.
    hparams: :class:`NTKDFLHParams`.
    run: the run's :class:`ntk_fl.settings.RunSettings` (its seed, ``topology.mixing``, ``model.init``).
    seed: the run seed (round keys), when no ``run``.
    mixing: mixing scheme of the per-round averaging, when no ``run``.
    shared_init: every client starts from the same initialisation, when no ``run``.
    targets_fn: the evolution-targets hook of :func:`make_client_update` (a variant's own targets).
    score_fn: the scoring hook of :func:`make_client_update` (how a variant picks ``τ``).

  Returns:
    An :class:`~ntk_fl.algorithms.base.Algorithm`; ``step`` is jit-compiled here
    (the federation's arrays are passed to it as arguments, never baked in as
    compile-time constants).
  """
  options = run_options(run, "NTK-DFL", topology, seed=seed, mixing=mixing, shared_init=shared_init)
  num_clients = federation.mask.shape[0]
  projection = None
  if (
    hparams.projection_dim
  ):  # Z = X P once for all samples: what every client computes with the shared P
    projection, model, federation = _project_federation(model, federation, hparams, options.seed)
  core = make_neighbourhood_round(
    model,
    federation,
    topology,
    seed=options.seed,
    mixing=options.mixing,
    lr=hparams.lr,
    lr_decay=hparams.lr_decay,
    per_round_averaging=hparams.per_round_averaging,
    jacobian_batches=int(hparams.jacobian_batches),
    subsample=int(hparams.subsample),
  )
  client_update = make_client_update(
    model, hparams, targets_fn=targets_fn, score_fn=score_fn, neighbourhood_slots=1 + topology.k_max
  )

  # Communication (ntk_fl.communication.neighbourhood_round_bits): static per-client package sizes.
  template = jax.eval_shape(model.init, jax.random.key(0))
  leaf_sizes = [math.prod(leaf.shape) for leaf in jax.tree.leaves(template)]
  keep, bits = float(hparams.sparsify_keep), int(hparams.quantize_bits)
  packages = jnp.asarray(
    [
      communication.jacobian_package_bits(
        int(n), model.num_classes, leaf_sizes, keep_fraction=keep, bits=bits
      )
      for n in core.samples_sent
    ],
    jnp.float32,
  )
  broadcast = topology.cliques > 0  # a clique member sends one package to the whole clique

  def init(key):
    return ParamsState(
      params=models.init_clients(model, key, num_clients, shared=options.shared_init),
      bits_cumulative=jnp.float32(0),
    )

  def round_fn(state, inputs, data, packages):
    (new_params, info), lr = core.run(state.params, inputs, data, client_update)
    bits_sent = communication.neighbourhood_round_bits(
      inputs.neighbor_mask.sum(axis=1).astype(jnp.float32),
      packages,
      sum(leaf_sizes),
      broadcast=broadcast,
      averaging=hparams.per_round_averaging,
    )
    total = jnp.sum(bits_sent)
    new_state = ParamsState(params=new_params, bits_cumulative=state.bits_cumulative + total)
    metrics = {
      "tau": info["tau"],
      "loss": info["loss"],
      "lr": lr,
      "bits_sent": bits_sent,
      "bits_sent_total": total,
      "bits_cumulative": new_state.bits_cumulative,
    }
    return new_state, metrics

  # One run: the package sizes are constants of its program; seed-batched runs pass them per seed.
  _step = jax.jit(lambda state, inputs, data: round_fn(state, inputs, data, packages))

  def step(state, inputs):
    return _step(state, inputs, core.data)

  def client_params(state):
    if projection is None:
      return state.params
    # P folded into the first layer: the d1-input network on raw inputs (the runner scores raw test inputs).
    return jacobians.fold_projection(state.params, projection, layer=model.dense_stack.layers[0])

  replicable = Replicable(
    lambda state, inputs, data: round_fn(state, inputs, *data), (core.data, packages)
  )
  return Algorithm(
    init=init,
    round_inputs=core.round_inputs,
    step=step,
    client_params=client_params,
    replicable=None if parallel.is_client_split(core.data.samples_x) else replicable,
  )


def _project_federation(model: models.Model, federation, hparams: NTKDFLHParams, seed: int):
  """``(P [d1, d1'], the MLP on d1' inputs, the federation with samples Z = X P)``: App. E.3's projection.

  ``P`` is CP-NTK-FL's shared seeded Gaussian (the same stream); the all-zero padding sample stays zero.
  """
  if len(federation.feature_shape) != 1:
    raise ValueError(
      "config.algorithm.projection_dim needs flattened inputs [S, d1], got samples of shape "
      f"{federation.feature_shape}"
    )
  input_dim = federation.feature_shape[0]
  projection = jacobians.projection_matrix(
    jax_key(seed, Stream.INPUT_PROJECTION),
    input_dim,
    int(hparams.projection_dim),
    scale=hparams.projection_scale,
  )
  samples_x = jacobians.project_inputs(jnp.asarray(federation.samples_x), projection)
  return (
    projection,
    models.mlp_on_inputs(model, int(hparams.projection_dim)),
    federation._replace(samples_x=samples_x),
  )


def _batched_update(step, params, x, targets, mask, lr):
  """Jacobian batching (m1 > 1): sequential block evolutions linearised at ``params``.

  Block ``b`` uses the kernel and the Jacobians at the round's averaged weights
  ``params`` (fixed linearisation point) but starts its function evolution from
  the outputs of the current, already updated, network; each block selects its
  own ``τ`` and its update is added before the next block.
  """

  def block(current, batch):
    xb, tb, mb = batch
    delta, info = step(params, xb, tb, mb, lr, current)
    current = jax.tree.map(jnp.add, current, delta)
    return current, (info["tau"], info["loss"])

  final, (block_taus, block_losses) = jax.lax.scan(block, params, (x, targets, mask))
  # Per-client summaries over the blocks, weighted by their real samples (an empty block chooses nothing).
  sizes = mask.sum(axis=1).astype(jnp.float32)
  weights = sizes / jnp.maximum(sizes.sum(), 1.0)
  return final, {"tau": jnp.sum(weights * block_taus), "loss": jnp.sum(weights * block_losses)}


def shared_rounds(stored: dict, current: dict) -> int:
  """Rounds two NTK-DFL configs (JSON dicts) compute identically (the runner's branch check).

  The round reads neither ``rounds`` nor ``eval.stop_at`` (the learning rate
  decays with the round index only), so configs differing only there share
  every round both run: a run stopped at its bound or at 85 % continues as the
  longer run (``--branch_from``).
  """
  unread = ("rounds", "eval.stop_at")
  same = config_without(stored, *unread) == config_without(current, *unread)
  return min(stored["rounds"], current["rounds"]) if same else 0


METHOD = Method(
  make=make_ntk_dfl,
  hyperparameters=NTKDFLHParams,
  check=check,
  graph=True,
  shared_rounds=shared_rounds,
  replicas=True,
  ntk=ntk_step.NTK_FUNCTIONS,
)
