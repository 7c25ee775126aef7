"""Privacy evaluation: gradient inversion on transmitted Jacobians, and image metrics.

NTK-FL / NTK-DFL clients transmit the per-sample Jacobians ``J(x_i) = ∂f(x_i; w)/∂w``
(``C`` outputs × ``d`` parameters per sample) of their data at weights ``w`` the
receiver knows. The attack here is deep leakage from gradients (DLG, Zhu et al.
2019) applied to one sample's Jacobian, as in NTK-DFL Appendix F and NTK-FL
Appendix B: optimise a dummy input ``x'`` so that its Jacobian matches the
observed one,

    min_x'  D(M ⊙ J(x'), J_obs),

where ``M`` is the support the sender transmitted (CP-NTK-FL's magnitude top-k
of every output row, :func:`ntk_fl.jacobians.sparsify_rows`: the receiver knows
which coordinates were kept, so it applies the same mask to the dummy's
Jacobian; dense: all ones) and ``D`` is

* ``'l2'``: ``Σ (M ⊙ J(x') − J_obs)²``, DLG's squared Euclidean distance;
* ``'cosine'``: ``1 − <M ⊙ J(x'), J_obs> / (‖M ⊙ J(x')‖ ‖J_obs‖)``, the
  scale-free distance of Geiping et al. (2020).

DLG also optimises a dummy soft label because a *loss* gradient depends on the
label; a Jacobian of the network outputs does not, so only the input is
optimised. The optimiser is optax Adam with cosine-decayed step size
(``'adam'``, the default: robust on the ReLU network's piecewise-quadratic
landscape) or L-BFGS (``'lbfgs'``, DLG's choice), run for a fixed number of
steps inside one ``lax.scan`` -- the attack is a pure function that ``jit``s and
``vmap``s over samples (each sample's Jacobian is a separate observation; the
shuffling server of CP-NTK-FL permutes samples, which a per-sample attack does
not care about).

With CP-NTK-FL's input projection the network sees ``z = x P`` (``P`` of shape
``[d1, d1']``, ``d1' < d1``) and the attack, run on the projected network,
recovers ``z``, not ``x``. Turning ``z`` into an image needs ``P``, which the
receiver does not hold (a trusted key server distributes its seed). :func:`unproject`
gives the minimum-norm preimage ``x̂`` with ``x̂ P = z`` for any candidate ``P``;
``experiments/privacy_attack.py`` documents which candidate it uses.

Image metrics: :func:`ssim` (Wang et al. 2004: Gaussian window 11, σ = 1.5,
``K1 = 0.01``, ``K2 = 0.03``, statistics over 'valid' window positions only, as
in the authors' ``ssim_index.m``; the mean of the SSIM map; equal to ``dm_pix.ssim``
within float32 rounding, which tests/test_privacy.py checks) and :func:`mse`.

Used by one script only, ``experiments/privacy_attack.py`` (the CP-NTK-FL attack
study): no method, the runner or the commands import this module. It lives in the
package, beside :mod:`ntk_fl.jacobians` whose transmitted Jacobians it attacks, so
a researcher can run the attack on any model from the flat API.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from ntk_fl import compression, jacobians, validation

__all__ = [
  "DISTANCES",
  "OPTIMIZERS",
  "Observation",
  "AttackState",
  "AttackResult",
  "Attack",
  "sample_jacobian",
  "observe",
  "ntk_dfl_observations",
  "jacobian_distance",
  "make_attack",
  "unproject",
  "gaussian_window",
  "ssim",
  "mse",
]

DISTANCES = ("l2", "cosine")
OPTIMIZERS = ("adam", "lbfgs")

Params = Any
ApplyFn = Callable[[Params, jax.Array], jax.Array]
_HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------
# What the receiver observes.


class Observation(NamedTuple):
  """One sample's Jacobian as the receiver gets it (flat layout of :mod:`ntk_fl.jacobians`).

  Attributes:
    jacobian: ``[C, d]`` the received values, zero outside the transmitted support.
    mask: ``[C, d]`` bool, the transmitted support (all ``True`` when dense). A
      sparse payload carries its support (bitmap or index list,
      :func:`ntk_fl.communication.jacobian_payload_bits`), so the receiver knows it.
  """

  jacobian: jax.Array
  mask: jax.Array


def sample_jacobian(apply_fn: ApplyFn, params: Params, x: jax.Array) -> jax.Array:
  """One sample's flat Jacobian ``[C, d]`` (:func:`ntk_fl.jacobians.flat_jacobian` of ``x[None]``).

  Args:
    apply_fn: ``apply(params, x [B, *in]) -> [B, C]``.
    params: the weights ``w`` the Jacobian is taken at.
    x: one input ``[*in]``.
  """
  return jacobians.flat_jacobian(apply_fn, params, x[None])[0]


def observe(
  jacobian: jax.Array, keep_fraction: float = 1.0, bits: int = compression.FLOAT_BITS
) -> Observation:
  """The receiver's view of one sample's Jacobian after CP-NTK-FL's compression.

  Args:
    jacobian: ``[C, d]`` one sample's flat Jacobian (:func:`sample_jacobian`).
    keep_fraction: fraction in ``(0, 1]`` of every output row's ``d`` entries
      kept by magnitude (:func:`ntk_fl.jacobians.sparsify_rows`); ``1`` = dense.
    bits: ``32`` sends float32 values; fewer quantises the kept values to
      ``bits`` bits (:func:`ntk_fl.jacobians.quantize_kept`, deterministic
      rounding, one range for this sample's payload).

  Returns:
    An :class:`Observation`. ``vmap`` it for a batch of samples.
  """
  keep_fraction = validation.check_real("keep_fraction", keep_fraction, 0.0, 1.0, low_open=True)
  if bits != compression.FLOAT_BITS:
    validation.check_int("bits", bits, low=1, high=16)
  jacobian = jnp.asarray(jacobian)
  if jacobian.ndim != 2:
    raise ValueError(f"observe takes one sample's flat Jacobian [C, d], got shape {jacobian.shape}")
  if keep_fraction == 1.0:
    values, mask = jacobian, jnp.ones(jacobian.shape, bool)
  else:
    values, mask = jacobians.sparsify_rows(jacobian, keep_fraction)
  if bits != compression.FLOAT_BITS:
    values = jacobians.quantize_kept(values, mask, bits)
  return Observation(values, mask)


def ntk_dfl_observations(
  apply_fn: ApplyFn,
  params: Params,
  x: jax.Array,
  *,
  keep_fraction: float = 1.0,
  bits: int = compression.FLOAT_BITS,
  mask: jax.Array | None = None,
  num_senders: int = 1,
) -> Observation:
  """The receiver's view of every sample of NTK-DFL senders' packages (App. E.3 compression).

  An NTK-DFL sender's package is its samples' Jacobian rows at the receiver's weights, one tensor
  ``[n, C, *leaf]`` per parameter tensor; :func:`ntk_fl.compression.compress_packages` (the call the
  NTK-DFL client update makes) keeps the ``keep_fraction`` largest magnitudes of each *package
  tensor* -- over all the sender's samples and outputs jointly, not per sample or per output row
  as :func:`observe` (CP-NTK-FL) does -- and quantises the package tensor with one ``bits``-bit
  min-max range. The support is sent with the values, so the receiver knows it.

  Args:
    apply_fn: ``apply(params, x [B, *in]) -> [B, C]`` (under projection: the MLP on ``d1'`` inputs).
    params: the receiver's weights, at which the senders take the Jacobians.
    x: ``[num_senders * n, *in]`` the senders' samples, sender after sender (projected inputs
      ``z = x P`` under projection); padding rows (``mask`` False) are zeroed as the client does.
    keep_fraction: top-k fraction per package tensor in ``(0, 1]`` (``sparsify_keep``; 1 = dense).
    bits: ``quantize_bits`` (32 = float32).
    mask: optional bool ``[num_senders * n]``, the real samples (default all).
    num_senders: packages stacked in ``x`` (a receiver's neighbourhood; 1 = one sender's package).

  Returns:
    An :class:`Observation` with ``[num_senders * n, C, d]`` values and support in the flat layout of
    :func:`ntk_fl.jacobians.flatten_jacobian`, sample ``i``'s rows at index ``i``.
  """
  keep_fraction = validation.check_real("keep_fraction", keep_fraction, 0.0, 1.0, low_open=True)
  if bits != compression.FLOAT_BITS:
    validation.check_int("bits", bits, low=1, high=16)
  x = jnp.asarray(x)
  mask = jnp.ones(x.shape[0], bool) if mask is None else jnp.asarray(mask, bool)
  num_senders = validation.check_int("num_senders", num_senders, low=1)
  if x.shape[0] % num_senders or mask.shape != x.shape[:1]:
    raise ValueError(
      f"ntk_dfl_observations needs num_senders * n samples and a mask [num_senders * n], got "
      f"{x.shape[0]} samples, mask {mask.shape} and num_senders = {num_senders}"
    )
  # As the client update: padding rows zeroed, then the Jacobian of the whole stack at once.
  xs = jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
  leaves = jax.tree.leaves(jacobians.per_sample_jacobian(apply_fn, params, xs))
  sent = compression.compress_packages(leaves, mask, num_senders, keep_fraction, bits)
  real_rows = [int(r) for r in mask.reshape(num_senders, -1).sum(axis=1)]
  supports = []
  for leaf in leaves:  # compress_packages' top-k: the magnitudes of each package's real entries
    real = mask.reshape((-1,) + (1,) * (leaf.ndim - 1))
    if keep_fraction == 1:
      supports.append(jnp.broadcast_to(real, leaf.shape))
      continue
    packages = jnp.abs(jnp.where(real, leaf, 0)).reshape(num_senders, -1)
    kept = [
      compression.top_k_by_key(
        compression.magnitude_key(package),
        compression.num_kept(r * math.prod(leaf.shape[1:]), keep_fraction) if r else 0,
      )
      for package, r in zip(packages, real_rows)
    ]
    supports.append(jnp.stack(kept).reshape(leaf.shape) & real)
  return Observation(jacobians.flatten_jacobian(list(sent)), jacobians.flatten_jacobian(supports))


# ----------------------------------------------------------------------------
# The attack.


def jacobian_distance(
  dummy_jacobian: jax.Array, observation: Observation, distance: str = "l2"
) -> jax.Array:
  """``D(M ⊙ J(x'), J_obs)`` (see the module docstring); a scalar.

  Args:
    dummy_jacobian: ``[C, d]`` the dummy input's Jacobian (dense).
    observation: the received Jacobian and its support ``M``.
    distance: one of :data:`DISTANCES`.
  """
  validation.check_choice("distance", distance, DISTANCES)
  dummy = jnp.where(observation.mask, dummy_jacobian, 0).reshape(-1)
  target = observation.jacobian.reshape(-1)
  if distance == "l2":
    return jnp.sum(jnp.square(dummy - target))
  # The tiny floor only guards 0/0 for an all-zero dummy Jacobian (dead ReLUs everywhere).
  tiny = jnp.finfo(dummy.dtype).tiny
  norms = jnp.sqrt(jnp.sum(jnp.square(dummy)) * jnp.sum(jnp.square(target)))
  return 1.0 - jnp.dot(dummy, target, precision=_HIGHEST) / jnp.maximum(norms, tiny)


class AttackState(NamedTuple):
  """The optimiser's state: dummy ``x' = scale · u``; ``u`` is what is optimised."""

  u: jax.Array  # [*input_shape]
  opt_state: Any


class AttackResult(NamedTuple):
  """Outcome of one attack.

  Attributes:
    x: the reconstruction ``[*input_shape]`` (input units, e.g. normalised pixels
      or projected inputs ``z``).
    losses: ``[steps]`` the distance before each optimiser step.
  """

  x: jax.Array
  losses: jax.Array


class Attack(NamedTuple):
  """A gradient-inversion attack as pure functions (all ``jit``/``vmap``-able).

  Attributes:
    init: ``init(key) -> AttackState``: dummy ``u ~ N(0, 1)``.
    step: ``step(state, observation) -> (state, loss)``: one optimiser step.
    run: ``run(observation, key) -> AttackResult``: ``init`` then ``steps`` steps.
  """

  init: Callable[[jax.Array], AttackState]
  step: Callable[[AttackState, Observation], tuple[AttackState, jax.Array]]
  run: Callable[[Observation, jax.Array], AttackResult]


def make_attack(
  apply_fn: ApplyFn,
  params: Params,
  input_shape: Sequence[int],
  *,
  steps: int,
  learning_rate: float,
  distance: str = "l2",
  optimizer: str = "adam",
  scale: float = 1.0,
) -> Attack:
  """DLG on one sample's (possibly sparsified) Jacobian at the known weights ``params``.

  Args:
    apply_fn: ``apply(params, x [B, *in]) -> [B, C]``.
    params: the weights the victim's Jacobian was taken at (known to the receiver).
    input_shape: shape of one input of ``apply_fn`` (``(784,)``; ``(d1',)``
      under input projection).
    steps: optimiser steps of :attr:`Attack.run` (an int >= 1).
    learning_rate: Adam's initial step size (cosine-decayed to 1% of it over
      ``steps``, which settles the last iterations); L-BFGS's initial step
      before its zoom line search. In units of ``u``.
    distance: one of :data:`DISTANCES`.
    optimizer: one of :data:`OPTIMIZERS`.
    scale: the dummy is ``x' = scale · u`` with ``u`` initialised ``N(0, 1)``:
      the attacker's prior on the input's per-coordinate size (``1`` for
      standardised pixels and for inputs projected with the default
      ``1/sqrt(d1)``-scaled ``P`` of :func:`ntk_fl.jacobians.projection_matrix`;
      ``sqrt(d1)`` with an unscaled ``P``). Also makes ``learning_rate``
      scale-free.

  Returns:
    An :class:`Attack`.
  """
  input_shape = tuple(validation.check_int("input_shape entry", s, low=1) for s in input_shape)
  steps = validation.check_int("steps", steps, low=1)
  learning_rate = validation.check_real("learning_rate", learning_rate, 0.0, low_open=True)
  scale = validation.check_real("scale", scale, 0.0, low_open=True)
  validation.check_choice("distance", distance, DISTANCES)
  validation.check_choice("optimizer", optimizer, OPTIMIZERS)

  def loss_fn(u, observation):
    return jacobian_distance(sample_jacobian(apply_fn, params, scale * u), observation, distance)

  if optimizer == "adam":
    tx = optax.adam(optax.cosine_decay_schedule(learning_rate, steps, alpha=0.01))
  else:
    tx = optax.lbfgs(learning_rate=learning_rate)

  def init(key):
    u = jax.random.normal(key, input_shape, jnp.float32)
    return AttackState(u, tx.init(u))

  def step(state, observation):
    objective = lambda u: loss_fn(u, observation)
    if optimizer == "lbfgs":
      # L-BFGS's line search reuses the value/gradient it stored at the accepted point.
      loss, grad = optax.value_and_grad_from_state(objective)(state.u, state=state.opt_state)
      updates, opt_state = tx.update(
        grad, state.opt_state, state.u, value=loss, grad=grad, value_fn=objective
      )
    else:
      loss, grad = jax.value_and_grad(objective)(state.u)
      updates, opt_state = tx.update(grad, state.opt_state, state.u)
    return AttackState(optax.apply_updates(state.u, updates), opt_state), loss

  def run(observation, key):
    final, losses = jax.lax.scan(lambda s, _: step(s, observation), init(key), None, length=steps)
    return AttackResult(scale * final.u, losses)

  return Attack(init=init, step=step, run=run)


def unproject(z: jax.Array, projection: jax.Array) -> jax.Array:
  """Minimum-norm preimage ``x̂`` of projected inputs: the smallest ``x̂`` with ``x̂ P = z``.

  Args:
    z: ``[..., d1']`` projected inputs.
    projection: ``P [d1, d1']`` (``d1' <= d1``).

  Returns:
    ``[..., d1]``: ``z pinv(P) = z (PᵀP)⁻¹ Pᵀ``, the component of any ``x`` with
    ``x P = z`` in the column space of ``P``; the ``d1 − d1'`` directions ``P``
    annihilates are lost. Solved through the ``d1' × d1'`` normal equations
    (an SVD of ``P`` is ~100x slower on CPU): ``P`` must have full column rank,
    and the error grows with ``cond(P)²`` -- about 9 for a Gaussian 784 × 200 ``P``.
  """
  if (
    projection.ndim != 2
    or z.shape[-1] != projection.shape[1]
    or projection.shape[1] > projection.shape[0]
  ):
    raise ValueError(
      f"unproject needs z [..., d1'] and P [d1, d1'] with d1' <= d1, got {z.shape} and "
      f"{projection.shape}"
    )
  gram = jnp.matmul(projection.T, projection, precision=_HIGHEST)  # [d1', d1']
  coeffs = jnp.linalg.solve(gram, z.reshape(-1, z.shape[-1]).T).T  # [B, d1']
  return jnp.matmul(coeffs, projection.T, precision=_HIGHEST).reshape(
    *z.shape[:-1], projection.shape[0]
  )


# ----------------------------------------------------------------------------
# Image metrics.


def gaussian_window(size: int = 11, sigma: float = 1.5) -> jax.Array:
  """``[size, size]`` Gaussian window summing to 1 (MATLAB ``fspecial('gaussian', size, sigma)``)."""
  size = validation.check_int("window_size", size, low=1)
  sigma = validation.check_real("sigma", sigma, 0.0, low_open=True)
  offsets = jnp.arange(size, dtype=jnp.float32) - (size - 1) / 2
  g = jnp.exp(-(offsets**2) / (2 * sigma**2))
  window = jnp.outer(g, g)
  return window / jnp.sum(window)


def _filter_valid(image: jax.Array, window: jax.Array) -> jax.Array:
  """Weighted sums over every window position fully inside the image: ``[H, W] -> [H-k+1, W-k+1]``.

  The window is symmetric, so convolution and correlation agree.
  """
  return jax.scipy.signal.convolve2d(image, window, mode="valid", precision=_HIGHEST)


def ssim(
  x: jax.Array,
  y: jax.Array,
  *,
  data_range: float = 1.0,
  window_size: int = 11,
  sigma: float = 1.5,
  k1: float = 0.01,
  k2: float = 0.03,
) -> jax.Array:
  """Structural similarity (Wang, Bovik, Sheikh, Simoncelli 2004) of grayscale images.

  Per window position, with Gaussian-weighted means ``μ``, variances ``σ²`` and
  covariance ``σ_xy`` (weights summing to 1, no Bessel correction),

    SSIM = (2 μx μy + C1)(2 σxy + C2) / ((μx² + μy² + C1)(σx² + σy² + C2)),

  ``C1 = (k1 L)²``, ``C2 = (k2 L)²``, ``L = data_range``; the result is the mean
  over the ``(H − k + 1) × (W − k + 1)`` valid positions. ``ssim(x, x) = 1``.

  Args:
    x, y: ``[..., H, W]`` images (same shape), ``H, W >= window_size``; leading
      axes are batch axes.
    data_range: ``L``, the dynamic range of the pixel values (1 for ``[0, 1]``).
    window_size, sigma: the Gaussian window.
    k1, k2: the stabilising constants.

  Returns:
    ``[...]`` SSIM per image pair.
  """
  x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  if x.shape != y.shape or x.ndim < 2:
    raise ValueError(
      f"ssim needs two images [..., H, W] of the same shape, got {x.shape} and {y.shape}"
    )
  window = gaussian_window(window_size, sigma)
  if x.shape[-2] < window_size or x.shape[-1] < window_size:
    raise ValueError(
      f"ssim needs images at least window_size={window_size} on each side, got {x.shape[-2:]}"
    )
  data_range = validation.check_real("data_range", data_range, 0.0, low_open=True)
  c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2

  def one(a, b):
    mu_a, mu_b = _filter_valid(a, window), _filter_valid(b, window)
    var_a = _filter_valid(a * a, window) - mu_a**2
    var_b = _filter_valid(b * b, window) - mu_b**2
    cov = _filter_valid(a * b, window) - mu_a * mu_b
    ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / (
      (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    )
    return jnp.mean(ssim_map)

  batch = x.shape[:-2]
  flat = jax.vmap(one)(x.reshape(-1, *x.shape[-2:]), y.reshape(-1, *y.shape[-2:]))
  return flat.reshape(batch)


def mse(x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean squared error per image pair: ``[..., H, W]`` -> ``[...]``."""
  x, y = jnp.asarray(x), jnp.asarray(y)
  if x.shape != y.shape or x.ndim < 2:
    raise ValueError(
      f"mse needs two images [..., H, W] of the same shape, got {x.shape} and {y.shape}"
    )
  return jnp.mean(jnp.square(x - y), axis=(-2, -1))
