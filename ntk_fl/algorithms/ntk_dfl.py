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

import jax
import jax.numpy as jnp

from ntk_fl import (
  communication,
  compression,
  jacobians,
  models,
  parallel,
  validation,
)
from ntk_fl.algorithms.base import Method
from ntk_fl._src import ntk_step
from ntk_fl._src.kernels import dense_stack_jacobian
from ntk_fl._src.options import Kernel, Loss, Select, Solver, check_taus
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
from ntk_fl.algorithms.neighbourhood_round import (  # re-exported: SPARK's round too
  NeighbourhoodRound,
  make_neighbourhood_round,
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

  @property
  def any_slot_count(self) -> bool:
    """Whether the client update fits a neighbourhood of any slot count (padded slots are masked
    samples), so a round may give each client its degree group's slots: uncompressed (compressed
    packages are per slot)."""
    return not self.compressed


def check(hparams: NTKDFLHParams, run) -> None:
  """Rules across blocks: the input projection needs the MLP."""
  if hparams.projection_dim and run.model.name != "mlp":
    raise ValueError(
      "config.algorithm.projection_dim projects flattened inputs into the first dense layer; it "
      f"needs model.name='mlp', got {run.model.name!r}"
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

  def client_update(params, x, hard, mask, lr):
    if m1 == 1:
      explicit = {}
      if hparams.compressed:  # the kernel and the update from the compressed packages
        explicit["jacobian"] = received_jacobian(
          model.apply,
          model.dense_stack,
          params,
          x[0],
          mask[0],
          slots=neighbourhood_slots,
          keep_fraction=keep,
          bits=bits,
        )
      delta, info = step(params, x[0], hard[0], mask[0], lr, None, **explicit)
      return jax.tree.map(jnp.add, params, delta), {"tau": info["tau"], "loss": info["loss"]}
    return _batched_update(step, params, x, hard, mask, lr)

  return client_update


def _call_targets(targets_fn, hard, f0):
  return targets_fn(f0, hard)


def received_jacobian(
  apply_fn, dense_stack, params, x, mask, *, slots: int, keep_fraction: float, bits: int
):
  """A compressing client's neighbourhood Jacobian as it holds it (App. E.3): per tensor, ``[N, C, *leaf]``.

  ``x [N, ...]`` holds ``slots`` equal slots of rows, the client's own first: its own rows stay exact,
  every other slot is one neighbour's package, compressed by :func:`ntk_fl.compression.compress_packages`
  (top-k ``keep_fraction`` of its real entries, ``bits``-bit values); padding rows (``mask`` False) are
  zero. ``dense_stack``: the model's layer factors (the Jacobian of an MLP written once from them), or
  ``None`` for the generic per-sample Jacobian of ``apply_fn``.
  """
  xs = jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
  # An MLP's Jacobian from its layer factors, the same entries written once (not transposed and copied).
  jac = None if dense_stack is None else dense_stack_jacobian(dense_stack, params, xs)
  if jac is None:
    jac = jacobians.per_sample_jacobian(apply_fn, params, xs)
  leaves, treedef = jax.tree.flatten(jac)
  sent = jnp.arange(slots) > 0  # the client's own rows (slot 0) are never transmitted
  leaves = compression.compress_packages(leaves, mask, slots, keep_fraction, bits, sent=sent)
  return jax.tree.unflatten(treedef, leaves)


def transmitted_step(
  apply_fn,
  params,
  x,
  targets,
  mask,
  *,
  lr,
  keep_fraction: float,
  bits: int,
  slots: int,
  dense_stack=None,
  **options,
):
  """A compressing client's NTK step on its neighbourhood block ``x [N, ...]`` of ``slots`` equal slots:
  the kernel and the update from :func:`received_jacobian` (what the client update does when
  ``NTKDFLHParams.compressed``, and what the run's cost estimate times for it). ``options`` go to
  :func:`ntk_fl.evolve.ntk_step`; returns ``(Δw, info)``."""
  jac = received_jacobian(
    apply_fn,
    dense_stack,
    params,
    x,
    mask,
    slots=slots,
    keep_fraction=keep_fraction,
    bits=bits,
  )
  return ntk_step.ntk_step(
    apply_fn, params, x, targets, mask, lr=lr, jacobian=jac, dense_stack=dense_stack, **options
  )


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
    # Compressed packages are per slot (App. E.3), so only the uncompressed update fits any slot count.
    group_by_degree=hparams.any_slot_count,
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
  ntk=ntk_step.NTK_FUNCTIONS._replace(
    transmitted_step=transmitted_step, projected_model=models.mlp_on_inputs
  ),
)
