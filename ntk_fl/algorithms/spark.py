"""SPARK (Xia, arXiv 2512.12737v2): NTK-DFL + Nesterov momentum + annealed distillation targets + sketches.

SPARK keeps NTK-DFL's round (:func:`ntk_fl.algorithms.neighbourhood_round.make_neighbourhood_round`:
graph, per-round averaging, neighbourhood gather, optional sub-sampling) and
changes the client update (paper Alg. 1-2; every choice is
recorded in ``configs/spark.py`` and docs/spark.md):

1. **Targets** (Alg. 2). Round ``k = r + 1`` (1-based) has mixing weight
   ``α_k`` and temperature ``T_k`` (:func:`distill_schedule`: ``α = 1, T = 1``
   during the ``R_warm`` warm-up rounds, then cosine-annealed ``α`` and linear
   ``T``). The teacher is the client's consensus model ``w̄_i`` on its
   neighbourhood data (the same function values ``f_0`` the evolution starts
   from, NTK-DFL's protocol: every neighbour computes at the receiver's ``w̄_i``),
   fixed within the round: ``Y = α Y_hard + (1 − α) softmax(f_0 / T)``.
2. **Evolution** of ``f`` under the (optionally sketched) kernel with the
   cross-entropy residual ``softmax(f) − Y`` (:mod:`ntk_fl.evolve`), candidate
   updates ``Δw_τ`` on the ``τ`` grid; ``τ*`` minimises the hard-label
   cross-entropy of the network ``w̄_i + Δw_τ`` (paper: "ground-truth labels").
3. **Sketch** (optional, :mod:`ntk_fl.projection`): the kernel is
   ``J̃ J̃ᵀ`` with ``J̃ = J P`` and the update is back-projected, ``Δw = P Δw̃``.
   Without compression this runs matrix-free on the lifted network
   ``g(u) = f(w̄ + P u)`` (its NTK *is* the sketched kernel; VJPs of ``g`` give
   ``J̃ᵀ v``). For a dense stack under the layer-wise sketch the kernel is the
   structured one with every layer input ``A_l`` replaced by ``A_l P_l``
   (:func:`ntk_fl.ntk.projected_dense_ntk`, ``projected_kernel='auto'``). The
   flattened sketch has no such kernel factorisation; for a dense stack ``J̃``
   is then assembled explicitly from the Jacobian's factors
   (:func:`ntk_fl.projection.sketched_dense_jacobian`, ``C`` times cheaper than
   per-sample Jacobians of ``g``, which other models use). With the
   compression stack (top-``ρ_sp`` sparsification and ``b``-bit quantisation of
   each neighbour's package) the sketched Jacobian is formed explicitly (from
   the factors for a dense stack), compressed per sender and per tensor, and
   both the kernel and the update are built from the compressed ``J̃``.
4. **Nesterov momentum** on ``Δw`` with optax (``optax.sgd(1, μ, nesterov=True)``
   fed ``−Δw``): ``v ← μ v + Δw``, ``w ← w̄ + μ v + Δw = w̄ + (1+μ) Δw + μ² v_old``.
   The velocity stays local (never averaged or sent).
5. **Linearisation point** (``linearise_at``). ``'receiver'`` (default; Option A
   of the paper's Alg. 1 read as NTK-DFL's protocol): every neighbour evaluates its
   Jacobian and logits at the receiver's ``w̄_i``. ``'sender'`` (Option B, Alg. 1
   lines 5-8 literally): client ``j`` evaluates its (sketched, compressed)
   Jacobian ``J_j`` and logits ``z_j`` at its *own* ``w̄_j`` and broadcasts that one
   package to all neighbours; the receiver stacks them into its kernel
   ``J Jᵀ`` and update ``Δw = -(η/N) Jᵀ S`` (Jacobians from different
   linearisation points), starts the evolution from the stacked ``z`` (the
   teacher of the distillation targets too) and adds ``Δw`` to its own ``w̄_i``.
   It always materialises the stacked Jacobian. On a clustered topology both
   options coincide.
6. Optional **cyclic learning-rate boost** (off by default; the paper gives no
   details): ``η`` is multiplied by ``factor`` in the listed rounds.

Communication (per round, per client ``i`` with ``κ_i`` neighbours; bits):
``κ_i·d·32`` consensus weights out, ``κ_i·d·32`` averaged weights back (the
receiver-linearised protocol needs them) and one package per neighbour:
the (sketched, compressed) Jacobian of its ``n_i`` samples, ``n_i·C`` float32
function values and ``n_i·⌈log2 C⌉`` label bits. On a clustered topology every
member of a clique shares ``w̄``, so the package is broadcast once and no
weights go back (paper App. A.2); so does every client under Option B
(``linearise_at='sender'``: one package per client, at its own weights).
:func:`ntk_fl.communication.neighbourhood_round_bits` is the formula, shared with NTK-DFL: with the
sketch and compression off the two cost the same.

Metrics: ``tau``, ``loss`` (selected hard-label CE), ``confidence`` (the
teacher's mean top-class probability on the neighbourhood), ``delta_norm``
(``‖Δw_τ*‖``), ``step_norm`` (``‖w − w̄‖``, momentum included), ``bits_sent`` ``[M]``;
``lr`` (boost included), ``alpha``, ``temperature``, ``bits_sent_total``,
``bits_cumulative``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ntk_fl import (
  communication,
  compression,
  gossip,
  jacobians,
  models,
  ntk,
  parallel,
  projection,
  topology,
  validation,
)
from ntk_fl.algorithms.base import Method
from ntk_fl._src import ntk_step
from ntk_fl._src.options import Choice, JacobianPath, Kernel, Select, Solver, check_taus
from ntk_fl.algorithms.base import Algorithm, check_evolution, config_without, run_options
from ntk_fl.algorithms.neighbourhood_round import make_neighbourhood_round

__all__ = [
  "SparkState",
  "JacobianPath",
  "ProjectedKernel",
  "Velocity",
  "distill_schedule",
  "distill_targets",
  "momentum_transform",
  "nesterov_step",
  "make_client_update",
  "make_spark",
  "check",
  "SparkClient",
  "SparkTargetsFn",
  "SparkHParams",
  "DistillHParams",
  "SketchHParams",
  "PackageCompressionHParams",
  "LrBoostHParams",
  "METHOD",
]


class LinearisationPoint(Choice):
  """Where a sender's Jacobians are taken (Alg. 1): ``RECEIVER``, at the receiving client's ``w̄_i``
  (Option A; one linearisation point per neighbourhood kernel), or ``SENDER``, at each sender's own ``w̄_j``
  (Option B; one broadcast package per client)."""

  RECEIVER = "receiver"
  SENDER = "sender"


class ProjectedKernel(Choice):
  """The sketched kernel's computation (``config.algorithm.projected_kernel``): ``STRUCTURED``, the dense
  stack's factorisation (MLPs), ``GENERIC`` for any model, ``AUTO`` the former where it applies."""

  AUTO = "auto"
  STRUCTURED = "structured"
  GENERIC = "generic"


class Velocity(Choice):
  """The momentum velocity (``config.algorithm.velocity``): kept by each client (``LOCAL``, Alg. 1), or sent
  with the weights and averaged with the same mixing weights every round (``MIXED``, not in the paper)."""

  LOCAL = "local"
  MIXED = "mixed"


class SparkState(NamedTuple):
  """Stacked client state (leading client axis ``M``).

  Attributes:
    params: the client models.
    momentum: optax ``sgd`` state per client (its trace is ``−v``, the negated velocity).
    bits_cumulative: float32 scalar, bits sent by all clients so far.
  """

  params: Any
  momentum: Any
  bits_cumulative: Any


# ----------------------------------------------------------------------------- pure pieces


def distill_schedule(
  round_index,
  *,
  warmup_rounds: int,
  anneal_rounds: int,
  alpha_init: float,
  alpha_final: float,
  temp_init: float,
  temp_final: float,
):
  """``(α_k, T_k)`` of Alg. 2 for the 0-based ``round_index`` (``k = round_index + 1``).

  ``k <= R_warm``: ``(1, 1)``. Otherwise ``p = min((k − R_warm)/(R − R_warm), 1)``,
  ``α = α_f + ½(α_i − α_f)(1 + cos πp)``, ``T = T_i + (T_f − T_i) p``. Works on
  traced ``round_index``.
  """
  k = jnp.asarray(round_index, jnp.float32) + 1
  p = jnp.clip((k - warmup_rounds) / (anneal_rounds - warmup_rounds), 0.0, 1.0)
  alpha = alpha_final + 0.5 * (alpha_init - alpha_final) * (1 + jnp.cos(jnp.pi * p))
  temp = temp_init + (temp_final - temp_init) * p
  warm = k <= warmup_rounds
  return jnp.where(warm, 1.0, alpha), jnp.where(warm, 1.0, temp)


def distill_targets(logits, hard, alpha, temperature):
  """``α Y_hard + (1 − α) softmax(z / T)`` (Eq. 11); rows ``[N, C]``."""
  return alpha * hard + (1 - alpha) * jax.nn.softmax(logits / temperature, axis=-1)


def momentum_transform(mu: float, nesterov: bool = True) -> optax.GradientTransformation:
  """The momentum step as optax: feed it ``−Δw``, add its output to ``w̄``."""
  return optax.sgd(learning_rate=1.0, momentum=mu, nesterov=nesterov)


def nesterov_step(tx: optax.GradientTransformation, params, delta, state):
  """``w̄ + update(−Δw)`` and the new momentum state (paper Eqs. 12-13 for Nesterov)."""
  updates, state = tx.update(jax.tree.map(jnp.negative, delta), state, params)
  return optax.apply_updates(params, updates), state


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class DistillHParams:
  """Stage-wise annealed soft-label targets (``config.algorithm.distill``).

  Hard labels for ``warmup_rounds`` rounds, then α and T anneal from
  ``(alpha_init, temp_init)`` to ``(alpha_final, temp_final)`` over the horizon
  ``anneal_rounds`` (0 = the run's round count); off unless ``enabled``.
  """

  enabled: bool
  warmup_rounds: int
  anneal_rounds: int
  alpha_init: float
  alpha_final: float
  temp_init: float
  temp_final: float

  def __post_init__(self):
    path = "config.algorithm.distill"
    validation.check_bool(f"{path}.enabled", self.enabled)
    validation.check_int(f"{path}.warmup_rounds", self.warmup_rounds, low=0)
    validation.check_int(f"{path}.anneal_rounds (R; 0 = config.rounds)", self.anneal_rounds, low=0)
    a_init = validation.check_real(f"{path}.alpha_init", self.alpha_init, low=0, high=1)
    validation.check_real(f"{path}.alpha_final", self.alpha_final, low=0, high=a_init)
    t_init = validation.check_real(f"{path}.temp_init", self.temp_init, low=0, low_open=True)
    validation.check_real(f"{path}.temp_final", self.temp_final, low=t_init)


@dataclasses.dataclass(frozen=True)
class SketchHParams:
  """The Jacobian random projection (``config.algorithm.projection``; :mod:`ntk_fl.projection`)."""

  scheme: str
  k_proj: int
  skip_uncompressed: bool

  def __post_init__(self):
    validation.check_choice("config.algorithm.projection.scheme", self.scheme, projection.SCHEMES)
    validation.check_int("config.algorithm.projection.k_proj", self.k_proj, low=1)
    validation.check_bool("config.algorithm.projection.skip_uncompressed", self.skip_uncompressed)


@dataclasses.dataclass(frozen=True)
class PackageCompressionHParams:
  """Top-k sparsification and quantisation of the sent Jacobian packages (``config.algorithm.compression``)."""

  keep_fraction: float
  bits: int

  def __post_init__(self):
    validation.check_real(
      "config.algorithm.compression.keep_fraction", self.keep_fraction, low=0, high=1, low_open=True
    )
    if self.bits != compression.FLOAT_BITS:
      validation.check_int(
        "config.algorithm.compression.bits (32 = float32, no quantisation)",
        self.bits,
        low=1,
        high=16,
      )

  @property
  def active(self) -> bool:
    return self.keep_fraction < 1 or self.bits != compression.FLOAT_BITS


@dataclasses.dataclass(frozen=True)
class LrBoostHParams:
  """Learning-rate multiplier ``factor`` in the listed 1-based ``rounds`` (``config.algorithm.lr_boost``)."""

  rounds: tuple[int, ...]
  factor: float

  def __post_init__(self):
    for r in tuple(self.rounds):
      validation.check_int("config.algorithm.lr_boost.rounds (1-based round numbers)", r, low=1)
    validation.check_real("config.algorithm.lr_boost.factor", self.factor, low=0, low_open=True)


@dataclasses.dataclass(frozen=True)
class SparkHParams:
  """SPARK (``config.algorithm``; every value checked on construction; ``configs/spark.py`` documents each)."""

  lr: float
  lr_decay: float
  taus: tuple[int, ...]
  solver: Solver
  select: Select
  kernel: Kernel
  subsample: int
  momentum: float
  nesterov: bool
  velocity: Velocity
  select_momentum: bool
  share_cliques: bool
  jacobian: JacobianPath
  projected_kernel: ProjectedKernel
  distill: DistillHParams
  projection: SketchHParams
  compression: PackageCompressionHParams
  lr_boost: LrBoostHParams
  # Alg. 1's Option A (the receiver's w̄_i; configs stored before this existed ran it) or B (the sender's w̄_j).
  linearise_at: LinearisationPoint = LinearisationPoint.RECEIVER

  @property
  def any_slot_count(self) -> bool:
    """Whether the client update fits a neighbourhood of any slot count (padded slots are masked
    samples), so a round may give each client its degree group's slots: neither compressed packages
    nor Option B's senders, which are per slot."""
    return not self.compression.active and self.linearise_at == LinearisationPoint.RECEIVER

  def __post_init__(self):
    check_evolution(self)
    validation.check_int("config.algorithm.subsample", self.subsample, low=1)
    validation.check_real(
      "config.algorithm.momentum (μ)", self.momentum, low=0, high=1, high_open=True
    )
    validation.check_bool("config.algorithm.nesterov", self.nesterov)
    validation.check_bool("config.algorithm.select_momentum", self.select_momentum)
    validation.check_bool("config.algorithm.share_cliques", self.share_cliques)
    if self.select_momentum and self.select != Select.NETWORK:
      raise ValueError(
        "config.algorithm.select_momentum=True scores the network after the momentum step, so it "
        f"needs select='network' (got select={self.select!r})"
      )
    for name, kind in (
      ("distill", DistillHParams),
      ("projection", SketchHParams),
      ("compression", PackageCompressionHParams),
      ("lr_boost", LrBoostHParams),
    ):
      if not isinstance(getattr(self, name), kind):
        raise ValueError(
          f"config.algorithm.{name} must be a {kind.__name__}, got {getattr(self, name)!r}"
        )
    if (
      self.projected_kernel == ProjectedKernel.STRUCTURED
      and self.projection.scheme == "flattened"
      and self.jacobian == JacobianPath.IMPLICIT
    ):
      raise ValueError(
        "config.algorithm.projected_kernel='structured' with the flattened sketch builds J̃ from the "
        "dense stack's Jacobian factors, so it needs jacobian 'auto' or 'explicit' (got 'implicit': "
        "the matrix-free flattened kernel has no per-layer factorisation; use projected_kernel "
        "'generic' or 'auto')"
      )
    if self.linearise_at == LinearisationPoint.SENDER and self.jacobian == JacobianPath.IMPLICIT:
      raise ValueError(
        "config.algorithm.linearise_at='sender' stacks Jacobians taken at the senders' own weights, "
        "so the kernel needs them explicitly: use jacobian 'explicit' or 'auto' (got 'implicit')"
      )
    if self.compression.active and self.jacobian == JacobianPath.IMPLICIT:
      raise ValueError(
        "config.algorithm.jacobian='implicit' cannot apply the compression stack (keep_fraction < 1 "
        "or bits < 32 needs the explicit sketched Jacobian): use 'explicit' or 'auto'"
      )


def check(hparams: SparkHParams, run) -> None:
  """Rules across blocks: the annealing horizon against the round count; clique sharing vs momentum scoring."""
  if hparams.share_cliques and hparams.select_momentum and run.topology.name == "clustered":
    raise ValueError(
      "config.algorithm.share_cliques=True computes one update per clique, but select_momentum=True "
      "scores τ with each member's own velocity: set share_cliques=False to use both"
    )
  d = hparams.distill
  total = d.anneal_rounds or run.rounds
  if d.enabled and total <= d.warmup_rounds:
    raise ValueError(
      f"config.algorithm.distill: the annealing horizon R={total} must exceed "
      f"warmup_rounds={d.warmup_rounds} (p = (k − R_warm)/(R − R_warm))"
    )


# ----------------------------------------------------------------------------- client update


def _tree_norm(tree):
  return jnp.sqrt(sum(jnp.vdot(leaf, leaf) for leaf in jax.tree.leaves(tree)))


class SparkTargetsFn(Protocol):
  """The distillation-targets hook of SPARK's client update (:func:`make_client_update`)."""

  def __call__(
    self, f0: jax.Array, hard: jax.Array, alpha: jax.Array, temperature: jax.Array
  ) -> jax.Array:
    """Args: f0: ``[N, C]`` the teacher's logits (the consensus ``w̄_i`` on the neighbourhood, the outputs
    the evolution starts from; Option B: each sender's own); hard: ``[N, C]`` one-hot labels; alpha,
    temperature: the round's ``α_k``, ``T_k`` (:func:`distill_schedule`). Returns: the ``[N, C]`` targets
    (SPARK: :func:`distill_targets`)."""


class SparkClient(NamedTuple):
  """SPARK's client update (:func:`make_client_update`), for the ``run`` of the round of
  :func:`ntk_fl.algorithms.neighbourhood_round.make_neighbourhood_round`.

  Attributes:
    update: ``update(w̄, x [N, ...], hard [N, C], mask [N], lr, alpha, temperature, matrices, opt_state,
      senders=None) -> (w, opt_state, info)``: the NTK step (``delta``) then the momentum step
      (``momentum_step``) of one client on its neighbourhood (one block: ``x[0]`` of the round's
      ``[1, N, ...]``); ``senders`` (Option B, ``linearise_at='sender'``): the members' own consensus
      weights, leaves ``[1 + k_max, ...]``. ``info``: float32 scalars ``tau``, ``loss`` (the selected
      hard-label score), ``confidence``, ``delta_norm``, ``step_norm``.
    delta: ``delta(w̄, x, hard, mask, lr, alpha, temperature, matrices, opt_state, senders=None) -> (Δw,
      info)``, the NTK step alone (``info``: ``tau``, ``loss``, ``confidence``); ``opt_state`` is read only
      with ``select_momentum``.
    momentum_step: ``momentum_step(w̄, Δw, opt_state, info) -> (w, opt_state, info)``: Nesterov's step
      (:func:`nesterov_step`), ``info`` with ``delta_norm`` and ``step_norm`` added.
    momentum: the optax momentum transformation (``momentum.init(params)`` is a client's ``opt_state``).
    plan: the sketch's :func:`ntk_fl.projection.make_plan` (identity leaves when unsketched).
    matrices: the sketch's matrices, drawn from the seed (``None`` per unsketched leaf): pass them into the
      round's ``jit`` as an argument and on to ``update``, never bake them in as constants.
  """

  update: Any
  delta: Any
  momentum_step: Any
  momentum: optax.GradientTransformation
  plan: Any
  matrices: Any


def make_client_update(
  model: models.Model,
  hparams: SparkHParams,
  *,
  seed: int,
  neighbourhood_slots: int,
  targets_fn: SparkTargetsFn | None = None,
) -> SparkClient:
  """SPARK's client update, every setting of ``hparams`` forwarded (module docstring, steps 1-5).

  Args:
    model: the model (``apply``, ``dense_stack``, ``flax_apply``, ``per_sample``).
    hparams: :class:`SparkHParams` (enum fields already members).
    seed: the run seed (the sketch's matrices).
    neighbourhood_slots: ``1 + k_max``, the neighbourhood's slots of ``N / (1 + k_max)`` rows each (the
      client's own first): the compressed packages and Option B's senders are per slot.
    targets_fn: ``targets_fn(f0, hard, alpha, temperature) -> [N, C]``, the evolution targets
      (:class:`SparkTargetsFn`); default :func:`distill_targets`. ``τ`` is always chosen on ``hard``.

  Returns:
    A :class:`SparkClient`.

  Raises:
    ValueError: ``projected_kernel='structured'`` where the structured sketched kernel does not apply.
  """
  # The step's options, parsed (and the τ grid checked) once here rather than on every trace.
  taus = check_taus(tuple(hparams.taus))
  solver, select, kernel_kind = hparams.solver, hparams.select, hparams.kernel
  traced = kernel_kind == Kernel.TRACED
  select_momentum = bool(hparams.select_momentum)
  members = int(neighbourhood_slots)
  targets = distill_targets if targets_fn is None else targets_fn
  tx = momentum_transform(float(hparams.momentum), bool(hparams.nesterov))

  # The sketch: identical for all clients and rounds, generated once from the seed and the layer names.
  template = jax.eval_shape(model.init, jax.random.key(0))
  plan = projection.make_plan(
    template,
    hparams.projection.scheme,
    int(hparams.projection.k_proj),
    skip_uncompressed=bool(hparams.projection.skip_uncompressed),
  )
  sketched = any(s.kind != "identity" for s in plan)
  matrices = projection.sample_matrices(plan, seed) if sketched else tuple(None for _ in plan)
  keep, bits = float(hparams.compression.keep_fraction), int(hparams.compression.bits)
  at_sender = hparams.linearise_at == LinearisationPoint.SENDER
  explicit = (
    hparams.jacobian == JacobianPath.EXPLICIT
    or at_sender
    or (hparams.jacobian == JacobianPath.AUTO and hparams.compression.active)
  )
  # A sketch of a dense stack never differentiates through P (unless projected_kernel='generic'):
  # * layer-wise and matrix-free: the structured kernel with each layer input A_l replaced by A_l P_l
  #   (ntk.projected_dense_ntk; a small proj500 round ran ~350x faster than with per-sample Jacobians of g);
  # * flattened (no kernel factorisation), or explicit Jacobians for the compression stack: J̃ assembled from the
  #   Jacobian's factors (projection.sketched_dense_jacobian, C times fewer flops than per-sample Jacobians of g).
  # Other models use the generic paths on the lifted network g.
  dense = (
    sketched
    and model.dense_stack is not None
    and hparams.projected_kernel != ProjectedKernel.GENERIC
  )
  structured_sketch = dense and not explicit and hparams.projection.scheme == "layerwise"
  factored_jacobian = dense and not structured_sketch and hparams.jacobian != JacobianPath.IMPLICIT
  if (
    hparams.projected_kernel == ProjectedKernel.STRUCTURED
    and sketched
    and not (structured_sketch or factored_jacobian)
  ):
    raise ValueError(
      "config.algorithm.projected_kernel='structured' needs a dense-stack model (and, for the "
      "flattened sketch, jacobian 'auto' or 'explicit'); "
      f"got model dense_stack={model.dense_stack is not None}, scheme={hparams.projection.scheme!r}, "
      f"jacobian={hparams.jacobian!r}"
    )
  explicit = explicit or factored_jacobian

  def sketched_jacobian(w, x, mats):
    """The (sketched) Jacobian ``[N, C, *leaf]`` of ``x`` at ``w`` in the sketch's coordinates."""
    if factored_jacobian:
      return projection.sketched_dense_jacobian(plan, mats, model.dense_stack, w, x)
    coords = (
      projection.sketch_map(model.apply, w, plan, mats)
      if sketched
      else ntk_step.identity_map(model.apply, w)
    )
    return jacobians.per_sample_jacobian(coords.apply_fn, coords.point, x)

  def sender_packages(senders, x, mats):
    """Option B: each member's rows of ``x`` at its own ``w̄_j`` (``senders``: leaves ``[members, ...]``).

    Returns ``(J [N, C, *leaf], z [N, C])``, rows sender after sender as in the neighbourhood.
    """
    xs = x.reshape((members, -1) + x.shape[1:])
    jac, z = jax.lax.map(
      lambda a: (sketched_jacobian(a[0], a[1], mats), model.apply(a[0], a[1])), (senders, xs)
    )
    return jax.tree.map(lambda leaf: leaf.reshape((-1,) + leaf.shape[2:]), (jac, z))

  def client_delta(wbar, x, hard, mask, lr, alpha, temp, mats, opt_state, senders=None):
    """SPARK's NTK step at ``w̄`` on the neighbourhood ``x [N, ...]``: ``(Δw, info)`` (:func:`ntk_fl.evolve.ntk_step`).

    ``senders`` (Option B): the members' own consensus weights, leaves ``[members, ...]``.
    """
    mask = mask.astype(bool)
    x = jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
    coords = (
      projection.sketch_map(model.apply, wbar, plan, mats)
      if sketched
      else ntk_step.identity_map(model.apply, wbar)
    )
    kernel_options = {}
    if explicit:  # the kernel and the candidates from the explicit (compressed) sketched J̃
      if senders is None:
        jac = sketched_jacobian(wbar, x, mats)
      else:
        jac, kernel_options["f0"] = sender_packages(senders, x, mats)
      leaves, treedef = jax.tree.flatten(jac)
      if hparams.compression.active:
        leaves = compression.compress_packages(leaves, mask, members, keep, bits)
      kernel_options["jacobian"] = jax.tree.unflatten(treedef, leaves)
    elif structured_sketch:
      layer_sketches = projection.dense_stack_projections(plan, mats, model.dense_stack)
      kernel_options["kernel_matrix"] = ntk.projected_dense_ntk(
        model.dense_stack, wbar, x, projections=layer_sketches, trace_outputs=traced
      )
    elif not sketched:  # the model's own structured kernel: its dense stack, else layer-wise
      kernel_options.update(
        dense_stack=model.dense_stack,
        # Only without a dense stack (a CNN, a user's module): the MLP keeps the dense-stack kernel.
        flax_apply=model.flax_apply if model.dense_stack is None else None,
        per_sample=model.per_sample,
      )
    candidate = None
    if select_momentum:  # score the network the client will actually hold: w̄ + μ v_new + Δw_τ
      candidate = lambda dw: nesterov_step(tx, wbar, dw, opt_state)[0]
    delta, info = ntk_step.ntk_step(
      model.apply,
      wbar,
      x,
      lambda f0: targets(f0, hard, alpha, temp),
      mask,
      lr=lr,
      taus=taus,
      solver=solver,
      select=select,
      kernel=kernel_kind,
      # Unsketched: the network's own coordinates (ntk_step's default), so that the model's layer-wise
      # kernel (flax_apply) is used as by NTK-DFL; an explicit map would send a CNN to the generic kernel.
      param_map=coords if sketched else None,
      labels=hard,  # τ* by the hard-label cross-entropy (paper §1.4(f))
      candidate=candidate,
      **kernel_options,
    )
    # Diagnostic: the teacher's mean top-class probability (falls when the targets flatten the model).
    n = jnp.maximum(mask.sum(), 1)
    confidence = (
      jnp.sum(jnp.where(mask, jnp.max(jax.nn.softmax(info["f0"], axis=-1), axis=-1), 0)) / n
    )
    return delta, {"tau": info["tau"], "loss": info["loss"], "confidence": confidence}

  def momentum_step(wbar, delta, opt_state, info):
    new_params, opt_state = nesterov_step(tx, wbar, delta, opt_state)
    # ‖Δw‖ and the step actually taken ‖w − w̄‖: their ratio is the momentum's amplification.
    info = dict(
      info,
      delta_norm=_tree_norm(delta),
      step_norm=_tree_norm(jax.tree.map(jnp.subtract, new_params, wbar)),
    )
    return new_params, opt_state, info

  def update(wbar, x, hard, mask, lr, alpha, temp, mats, opt_state, senders=None):
    delta, info = client_delta(wbar, x, hard, mask, lr, alpha, temp, mats, opt_state, senders)
    return momentum_step(wbar, delta, opt_state, info)

  return SparkClient(
    update=update,
    delta=client_delta,
    momentum_step=momentum_step,
    momentum=tx,
    plan=plan,
    matrices=matrices,
  )


# ----------------------------------------------------------------------------- the method


def make_spark(
  model: models.Model,
  federation,
  graphs: topology.Topology,
  hparams: SparkHParams,
  run=None,
  *,
  seed: int | None = None,
  rounds: int | None = None,
  mixing: str | None = None,
  shared_init: bool | None = None,
  targets_fn: SparkTargetsFn | None = None,
) -> Algorithm:
  """Builds SPARK for ``federation`` and ``model``; ``step`` is jit-compiled here.

  Args:
    model: the model.
    federation: the stacked client data (``M`` clients).
    graphs: the communication :class:`ntk_fl.topology.Topology` over the ``M`` clients.
    hparams: :class:`SparkHParams`.
    seed: the run seed (round keys, the Jacobian sketch).
    rounds: the run's round count (the annealing horizon when ``distill.anneal_rounds`` is 0).
    mixing: mixing scheme of the per-round averaging.
    shared_init: every client starts from the same initialisation.
    targets_fn: the distillation-targets hook of :func:`make_client_update` (a variant's own targets).
  """
  seed, mixing, shared_init, rounds = run_options(
    run, "SPARK", graphs, seed=seed, mixing=mixing, shared_init=shared_init, rounds=rounds
  )
  if rounds is None:
    raise TypeError("make_spark needs the run settings or rounds=")
  num_clients = federation.mask.shape[0]
  num_classes = model.num_classes
  m2 = int(hparams.subsample)
  # On disjoint cliques every member has the same w̄ and data: one evolution per clique (exact up to float order).
  share_cliques = bool(hparams.share_cliques) and graphs.cliques > 0
  core = make_neighbourhood_round(
    model,
    federation,
    graphs,
    seed=seed,
    mixing=mixing,
    lr=hparams.lr,
    lr_decay=hparams.lr_decay,
    per_round_averaging=True,
    subsample=m2,
    share_cliques=share_cliques,
    group_by_degree=hparams.any_slot_count,
  )
  client = make_client_update(
    model, hparams, seed=seed, neighbourhood_slots=1 + graphs.k_max, targets_fn=targets_fn
  )
  tx, plan, matrices = client.momentum, client.plan, client.matrices
  mixed_velocity = hparams.velocity == Velocity.MIXED
  keep, bits = float(hparams.compression.keep_fraction), int(hparams.compression.bits)
  at_sender = hparams.linearise_at == LinearisationPoint.SENDER

  d = hparams.distill
  schedule = dict(
    warmup_rounds=int(d.warmup_rounds),
    anneal_rounds=int(d.anneal_rounds or rounds),
    alpha_init=float(d.alpha_init),
    alpha_final=float(d.alpha_final),
    temp_init=float(d.temp_init),
    temp_final=float(d.temp_final),
  )
  boost_rounds = jnp.asarray(tuple(int(r) for r in hparams.lr_boost.rounds) or (0,), jnp.int32)
  boost_factor = float(hparams.lr_boost.factor)

  # Communication: static per-client package sizes (samples after sub-sampling).
  sketch_sizes = [math.prod(s.projected_shape) for s in plan]
  packages = jnp.asarray(
    [
      communication.jacobian_package_bits(
        int(n), num_classes, sketch_sizes, keep_fraction=keep, bits=bits
      )
      for n in core.samples_sent
    ],
    jnp.float32,
  )
  num_params = sum(math.prod(s.shape) for s in plan)
  # A clique member sends one package to the whole clique; under Option B every client sends one package.
  broadcast = graphs.cliques > 0 or at_sender

  def init(key):
    params = models.init_clients(model, key, num_clients, shared=shared_init)
    return SparkState(
      params=params,
      momentum=parallel.for_each_client(tx.init, chunk_size=0)(params),
      bits_cumulative=jnp.float32(0),
    )

  @jax.jit
  def _step(state, inputs, data, mats):
    if d.enabled:
      alpha, temp = distill_schedule(inputs.round, **schedule)
    else:
      alpha, temp = jnp.float32(1), jnp.float32(1)
    boost = jnp.where(jnp.any(boost_rounds == inputs.round + 1), boost_factor, 1.0).astype(
      jnp.float32
    )

    # Option B: every client's own consensus, read by its neighbours (the round forms w̄_i per client again).
    consensus = (
      gossip.mix(state.params, inputs.neighbors, inputs.self_weight, inputs.neighbor_weights)
      if at_sender
      else None
    )

    def member_weights(members_i):
      return None if consensus is None else jax.tree.map(lambda w: w[members_i], consensus)

    # alpha, temp, the boost and the sketch (and Option B's consensus) are shared by all clients: closed
    # over, not mapped.
    def client_fn(wbar, x, targets, mask, lr, opt_state, members_i):
      return client.update(
        wbar,
        x[0],
        targets[0],
        mask[0],
        lr * boost,
        alpha,
        temp,
        mats,
        opt_state,
        member_weights(members_i),
      )

    def clique_fn(wbar, x, targets, mask, lr):  # no velocity: select_momentum is off (spark.check)
      delta, info = client.delta(
        wbar, x[0], targets[0], mask[0], lr * boost, alpha, temp, mats, None
      )
      return wbar, delta, info

    velocity = state.momentum
    if (
      mixed_velocity
    ):  # the velocity travels with the weights and is averaged with the same weights
      velocity = gossip.mix(velocity, inputs.neighbors, inputs.self_weight, inputs.neighbor_weights)
    if share_cliques:  # one evolution per clique, then every member's own momentum step
      (wbar, delta, info), lr = core.run(state.params, inputs, data, clique_fn)
      params, opt_state, info = parallel.for_each_client(client.momentum_step, chunk_size=0)(
        wbar, delta, velocity, info
      )
    else:
      member_index = jnp.concatenate([jnp.arange(num_clients)[:, None], inputs.neighbors], axis=1)
      (params, opt_state, info), lr = core.run(
        state.params, inputs, data, client_fn, velocity, member_index
      )
    bits_sent = communication.neighbourhood_round_bits(
      inputs.neighbor_mask.sum(axis=1).astype(jnp.float32),
      packages,
      num_params,
      broadcast=broadcast,
      velocity=mixed_velocity,
    )
    total = jnp.sum(bits_sent)
    new_state = SparkState(
      params=params, momentum=opt_state, bits_cumulative=state.bits_cumulative + total
    )
    metrics = {
      "tau": info["tau"],
      "loss": info["loss"],
      "confidence": info["confidence"],
      "delta_norm": info["delta_norm"],
      "step_norm": info["step_norm"],
      "lr": lr * boost,
      "alpha": alpha,
      "temperature": temp,
      "bits_sent": bits_sent,
      "bits_sent_total": total,
      "bits_cumulative": new_state.bits_cumulative,
    }
    return new_state, metrics

  def step(state, inputs):
    return _step(state, inputs, core.data, matrices)

  return Algorithm(
    init=init, round_inputs=core.round_inputs, step=step, client_params=lambda state: state.params
  )


def _schedule_table(config: dict, rounds: int) -> np.ndarray:
  """``[rounds, 2]`` ``(α_k, T_k)`` of a SPARK config (JSON dict); a disabled distillation is ``(1, 1)``."""
  d = config["algorithm"]["distill"]
  if not d["enabled"]:
    return np.ones((rounds, 2), np.float32)
  alpha, temp = distill_schedule(
    np.arange(rounds),
    warmup_rounds=d["warmup_rounds"],
    anneal_rounds=d["anneal_rounds"] or config["rounds"],
    alpha_init=d["alpha_init"],
    alpha_final=d["alpha_final"],
    temp_init=d["temp_init"],
    temp_final=d["temp_final"],
  )
  return np.stack([np.asarray(alpha), np.asarray(temp)], axis=-1)


def shared_rounds(stored: dict, current: dict) -> int:
  """How many leading rounds two SPARK configs (JSON dicts) compute identically (the runner's branch check).

  They may differ only in ``algorithm.distill`` and ``rounds`` (which sets the
  annealing length); the shared rounds are those in which both give the same
  ``(α_k, T_k)`` -- a disabled distillation counts as ``(1, 1)``, which is what
  the step then uses. So during the hard-label warm-up the Table 4 rows agree in
  pairs: ``abl_distill`` with ``abl_none``, SPARK with ``abl_momentum``.
  """
  compared = ("rounds", "algorithm.distill")  # compared through the schedules below
  if config_without(stored, *compared) != config_without(current, *compared):
    return 0
  rounds = min(stored["rounds"], current["rounds"])
  same = np.all(_schedule_table(stored, rounds) == _schedule_table(current, rounds), axis=-1)
  return rounds if same.all() else int(np.argmin(same))


METHOD = Method(
  make=make_spark,
  hyperparameters=SparkHParams,
  check=check,
  graph=True,
  shared_rounds=shared_rounds,
  ntk=ntk_step.NTK_FUNCTIONS,
)
