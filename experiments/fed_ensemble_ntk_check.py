"""NTK-regime check of Fed-ensemble (paper Sec. 4, Thm 4.2 / Cor. 4.1; fed_ensemble.md Sec. 3, 8.2).

Usage::

  python experiments/fed_ensemble_ntk_check.py --out_dir=runs/fed_ensemble_ntk_check

A wide one-hidden-layer ReLU network in NTK parameterisation,
``f(x) = (s_w / sqrt(m)) v . relu(s_w W x / sqrt(d) + s_b b1) + s_b b2`` (all
parameters ~ N(0, 1)), is trained with the Fed-ensemble schedule (every client
its own stratum, full participation, ``tau`` full-batch GD steps per round on
the client's half mean squared error, per-mode mean of the returned models)
on a heterogeneous regression set: client ``i`` holds points from its own arc
of the unit circle. Theorem 4.2 says that after training each mode is an
independent draw from ``GP(m, k)`` with

  ``m(x) = Theta(x,X) Theta^-1 Y``,
  ``k(x,x) = Kcal(x,x) + Theta(x,X) Theta^-1 Kcal(X,X) Theta^-1 Theta(X,x) - 2 Theta(x,X) Theta^-1 Kcal(X,x)``

(``Kcal`` the NNGP, ``Theta`` the NTK, both analytic here: arc-cosine
kernels), so the spread of the modes' predictions over modes and seeds should
match ``k(x, x)`` and the variance of the K-mode average should be ``k / K``
(Cor. 4.1).

Theorem 4.2 is an infinite-time statement; a run of finite length leaves part
of each mode's initial function in the slowest kernel directions. The sharp
check therefore compares with the *finite-time* prediction of the linearised
(infinite-width) network under exactly the schedule that was run: on the
points ``Z = [X; X_test]`` one local GD step of client ``i`` is the affine map
``f <- f - (lr / n_i) Theta(Z, X_i) (f(X_i) - Y_i)``, a round is the per-mode
mean of the participants' ``tau``-step maps (the same :func:`aggregate_modes`
as training), so every mode ends as ``f_T = M f_0 + c`` with ``f_0 ~ GP(0,
Kcal)``: mean ``c``, covariance ``M Kcal(Z, Z) M^T``. The modes' spread over
seeds and modes is then predicted as ``mean_{s,k}[diag(M Kcal M^T)] +
var_{s,k}(c)`` (the schedule-dependent means form a mixture), and the
K-mode average's as ``mean_s[(1/K^2) sum_k diag(M_k Kcal M_k^T)] +
var_s(mean_k c_k)`` (the modes' initialisations are independent). As the
number of rounds grows ``M, c`` approach Theorem 4.2's ``m, k``. Error bars
are jackknife standard errors over the seeds (deterministic, no extra draw).
Writes ``ntk_check.json`` and ``ntk_check.png``.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl.algorithms import fed_ensemble
from ntk_fl.rng import Stream, jax_key, numpy_rng

# Not "--out": the toy script defines that flag, and the tests import both modules into one process.
_OUT = flags.DEFINE_string("out_dir", "runs/fed_ensemble_ntk_check", "output directory")
# Several widths: the network approaches the (infinite-width) prediction like m^-1/2, extrapolated at the end.
_WIDTHS = flags.DEFINE_list("widths", ["256", "1024", "4096"], "hidden widths m")
_SEEDS = flags.DEFINE_integer("seeds", 128, "independent runs per K")
_MODES = flags.DEFINE_list("modes", ["1", "4"], "numbers of modes K")
_ROUNDS = flags.DEFINE_integer("rounds", 100, "communication rounds")
_TAU = flags.DEFINE_integer("tau", 8, "local GD steps per round")
# Small enough that the O(lr^2) and finite-width corrections stay below the Monte-Carlo error.
_LR = flags.DEFINE_float("lr", 1.0, "local GD step")
_SEED = flags.DEFINE_integer("seed", 0, "seed of every draw")

S_W, S_B = 1.0, 0.3
NUM_CLIENTS, POINTS, NUM_TEST = 8, 2, 16


def make_data(seed):
  """Client ``i``'s 2 points lie on its own arc of the unit circle (non-iid in x); a test set all around."""
  rng = numpy_rng(seed, Stream.SYNTHETIC_DATA)
  angle = (
    (np.arange(NUM_CLIENTS)[:, None] + rng.uniform(0, 1, (NUM_CLIENTS, POINTS)))
    * 2
    * np.pi
    / NUM_CLIENTS
  )
  x = np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32)  # [N, n, 2]
  y = (np.sin(3 * angle) + 0.1 * rng.normal(size=angle.shape)).astype(np.float32)
  test_angle = rng.uniform(0, 2 * np.pi, NUM_TEST)
  x_test = (0.8 * np.stack([np.cos(test_angle), np.sin(test_angle)], -1)).astype(np.float32)
  return x, y, x_test


def kernels(x1, x2):
  """Analytic NNGP ``Kcal`` and NTK ``Theta`` of the network above (float64)."""
  x1, x2 = np.asarray(x1, np.float64), np.asarray(x2, np.float64)
  d = x1.shape[-1]
  k1 = lambda a, b: S_W**2 * a @ b.T / d + S_B**2
  k12, k11, k22 = k1(x1, x2), np.diag(k1(x1, x1)), np.diag(k1(x2, x2))
  norm = np.sqrt(np.outer(k11, k22))
  theta = np.arccos(np.clip(k12 / norm, -1.0, 1.0))
  relu_relu = norm / (2 * np.pi) * (np.sin(theta) + (np.pi - theta) * np.cos(theta))
  step_step = (np.pi - theta) / (2 * np.pi)
  nngp = S_W**2 * relu_relu + S_B**2
  return nngp, nngp + S_W**2 * k12 * step_step


def gp_posterior(x, y, x_test):
  """Thm 4.2's mean and variance at ``x_test`` from the pooled training data."""
  kxx, txx = kernels(x, x)
  ksx, tsx = kernels(x_test, x)
  kss, _ = kernels(x_test, x_test)
  a = np.linalg.solve(txx, tsx.T).T  # Theta(x*,X) Theta^-1
  mean = a @ y
  var = np.diag(kss) + np.einsum("ij,jk,ik->i", a, kxx, a) - 2 * np.einsum("ij,ij->i", a, ksx)
  return mean, var


def client_maps(x, y, z, tau, lr):
  """Each client's ``tau`` local GD steps as an affine map on ``f(Z)``: ``([N, Z, Z], [N, Z])`` (float64).

  ``x [N, n, 2]``, ``y [N, n]``: the clients' data; ``z [Z, 2]``: the points
  the map acts on (the pooled training points first, then the test points).
  """
  num_clients, n = y.shape
  _, theta = kernels(z, x.reshape(-1, 2))  # [Z, N n]
  maps, shifts = [], []
  for i in range(num_clients):
    cols = slice(i * n, (i + 1) * n)
    step = np.eye(z.shape[0])
    step[:, cols] -= (
      lr / n * theta[:, cols]
    )  # f - (lr/n) Theta(Z, X_i) f(X_i): X_i are Z's rows i n .. (i+1) n - 1
    shift = lr / n * theta[:, cols] @ y[i]
    g, h = np.eye(z.shape[0]), np.zeros(z.shape[0])
    for _ in range(tau):
      g, h = step @ g, step @ h + shift
    maps.append(g)
    shifts.append(h)
  return np.stack(maps), np.stack(shifts)


def linearised_prediction(x, y, x_test, assignments, num_modes, tau, lr):
  """Finite-time NTK-GP moments of every (seed, mode) under its actual schedule.

  Args:
    assignments: int ``[S, rounds, N]``, the mode each client trained.

  Returns:
    ``(mean [S, K, T], variance [S, K, T], cross [S, T])``: each mode's mean
    and init-induced variance at the test points, and the init-induced variance
    of the K-mode average (``(1/K^2) sum_k`` of the modes' variances).
  """
  z = np.concatenate([x.reshape(-1, 2), x_test]).astype(np.float64)
  g, h = client_maps(x, y, z, tau, lr)
  nz, num_seeds = z.shape[0], assignments.shape[0]
  m = np.broadcast_to(np.eye(nz), (num_seeds, num_modes, nz, nz)).copy()
  c = np.zeros((num_seeds, num_modes, nz))
  for r in range(assignments.shape[1]):
    assign = assignments[:, r]  # [S, N]
    returned_m = np.einsum(
      "nab,snbc->snac", g, np.take_along_axis(m, assign[:, :, None, None], axis=1)
    )
    returned_c = (
      np.einsum("nab,snb->sna", g, np.take_along_axis(c, assign[:, :, None], axis=1)) + h[None]
    )
    # Remark 3.1 in numpy (independent of the library's aggregate_modes): a mode becomes the mean of the
    # maps of the clients that trained it this round; an idle mode keeps its map.
    member = (assign[:, :, None] == np.arange(num_modes)).astype(np.float64)  # [S, N, K]
    counts = member.sum(axis=1)  # [S, K]
    coeff = member / np.maximum(counts, 1.0)[:, None, :]
    trained = counts[:, :, None] > 0
    m = np.where(trained[..., None], np.einsum("snk,snab->skab", coeff, returned_m), m)
    c = np.where(trained, np.einsum("snk,sna->ska", coeff, returned_c), c)
  kcal, _ = kernels(z, z)
  test = slice(x.reshape(-1, 2).shape[0], None)
  m_test = m[:, :, test]  # [S, K, T, Z]
  variance = np.einsum("skta,ab,sktb->skt", m_test, kcal, m_test)
  return c[:, :, test], variance, variance.sum(axis=1) / num_modes**2


def jackknife(statistic, *per_seed):
  """``(value, standard error)`` of ``statistic(*arrays)`` by leave-one-seed-out (axis 0 = seeds)."""
  num_seeds = per_seed[0].shape[0]
  value = statistic(*per_seed)
  loo = np.array(
    [statistic(*(np.delete(a, s, axis=0) for a in per_seed)) for s in range(num_seeds)]
  )
  return float(value), float(np.sqrt((num_seeds - 1) / num_seeds * np.sum((loo - loo.mean()) ** 2)))


def mode_spread(preds):
  """``[S, K, T]`` -> mean over test points of the variance over seeds and modes."""
  return preds.reshape(-1, preds.shape[-1]).var(axis=0).mean()


def ensemble_spread(preds):
  """``[S, K, T]`` -> mean over test points of the variance over seeds of the K-mode average."""
  return preds.mean(axis=1).var(axis=0).mean()


def infinite_width_limit(rows):
  """Weighted least squares of ``ratio = a + b / sqrt(m)`` over widths; ``a`` is the infinite-width ratio.

  Uses ``mode_variance_ratio_finite_time`` (value, jackknife s.e.) of each row;
  ``None`` with fewer than two widths.
  """
  if len({r["width"] for r in rows}) < 2:
    return None
  design = np.array([[1.0, 1.0 / np.sqrt(r["width"])] for r in rows])
  value = np.array([r["mode_variance_ratio_finite_time"][0] for r in rows])
  weight = 1.0 / np.array([r["mode_variance_ratio_finite_time"][1] for r in rows]) ** 2
  normal = design.T @ (weight[:, None] * design)
  coef = np.linalg.solve(normal, design.T @ (weight * value))
  cov = np.linalg.inv(normal)
  return {
    "intercept": float(coef[0]),
    "intercept_se": float(np.sqrt(cov[0, 0])),
    "slope": float(coef[1]),
  }


def init(key, width):
  k = jax.random.split(key, 4)
  return {
    "w": jax.random.normal(k[0], (width, 2)),
    "b1": jax.random.normal(k[1], (width,)),
    "v": jax.random.normal(k[2], (width,)),
    "b2": jax.random.normal(k[3], ()),
  }


def apply(p, x):
  width, d = p["w"].shape
  h = S_W * x @ p["w"].T / np.sqrt(d) + S_B * p["b1"]
  return S_W / np.sqrt(width) * jax.nn.relu(h) @ p["v"] + S_B * p["b2"]


def train(modes, x, y, assignment, tau, lr):
  """Fed-ensemble rounds for one seed: ``modes`` leaves ``[K, ...]``, ``assignment [rounds, N]``."""
  loss = lambda p, xi, yi: 0.5 * jnp.mean(jnp.square(apply(p, xi) - yi))

  def local(p, xi, yi):
    step = lambda p, _: (jax.tree.map(lambda w, g: w - lr * g, p, jax.grad(loss)(p, xi, yi)), None)
    return jax.lax.scan(step, p, None, length=tau)[0]

  def round_(modes, assign):
    start = jax.tree.map(lambda w: w[assign], modes)
    trained = jax.vmap(local)(start, x, y)
    return fed_ensemble.aggregate_modes(modes, trained, assign, jnp.ones(assign.shape[0]))[0], None

  return jax.lax.scan(round_, modes, assignment)[0]


def run(out_dir: str) -> dict:
  os.makedirs(out_dir, exist_ok=True)
  x, y, x_test = make_data(_SEED.value)
  mean, var = gp_posterior(x.reshape(-1, 2), y.reshape(-1), x_test)
  rows, predictions = [], {}
  for width, k in [(int(w), int(k)) for w in _WIDTHS.value for k in _MODES.value]:
    t0 = time.perf_counter()
    assignment = np.stack(
      [
        np.stack(
          [
            fed_ensemble.round_modes(
              fed_ensemble.make_strata(NUM_CLIENTS, 0, 1000 * _SEED.value + s),
              k,
              1000 * _SEED.value + s,
              r,
            )
            for r in range(_ROUNDS.value)
          ]
        )
        for s in range(_SEEDS.value)
      ]
    )  # [S, rounds, N]
    keys = jax.vmap(
      lambda s: jax.random.split(
        jax.random.fold_in(jax_key(_SEED.value, Stream.ROUND_KEYS, k), s), k
      )
    )(jnp.arange(_SEEDS.value))
    modes = jax.vmap(jax.vmap(lambda key: init(key, width)))(keys)
    trained = jax.jit(jax.vmap(lambda m, a: train(m, x, y, a, _TAU.value, _LR.value)))(
      modes, assignment
    )
    preds = np.asarray(
      jax.vmap(jax.vmap(lambda p: apply(p, x_test)))(trained), np.float64
    )  # [S, K, T]
    fit = np.asarray(jax.vmap(jax.vmap(lambda p: apply(p, x.reshape(-1, 2))))(trained)) - y.reshape(
      -1
    )
    ensemble = preds.mean(axis=1)
    # The finite-time linearised (infinite-width) prediction for exactly these schedules.
    if k not in predictions:  # the same schedules at every width
      predictions[k] = linearised_prediction(x, y, x_test, assignment, k, _TAU.value, _LR.value)
    pred_c, pred_var, pred_cross = predictions[k]
    pred_mode = lambda c, v: v.mean() + c.reshape(-1, NUM_TEST).var(axis=0).mean()
    pred_ensemble = lambda c, cross: cross.mean() + c.mean(axis=1).var(axis=0).mean()
    mode_ratio = jackknife(
      lambda p, c, v: mode_spread(p) / pred_mode(c, v), preds, pred_c, pred_var
    )
    ens_ratio = jackknife(
      lambda p, c, cr: ensemble_spread(p) / pred_ensemble(c, cr), preds, pred_c, pred_cross
    )
    k_ratio = jackknife(lambda p: k * ensemble_spread(p) / mode_spread(p), preds)
    # Mean: the network's average over seeds and modes vs the predicted one, in units of its standard error.
    mean_gap = preds.reshape(-1, NUM_TEST).mean(axis=0) - pred_c.reshape(-1, NUM_TEST).mean(axis=0)
    mean_se = np.sqrt(preds.reshape(-1, NUM_TEST).var(axis=0) / (preds.shape[0] * k))
    rows.append(
      {
        "K": k,
        "width": width,
        "mode_variance": preds.reshape(-1, NUM_TEST).var(axis=0).tolist(),
        "ensemble_variance": ensemble.var(axis=0).tolist(),
        "mode_mean": preds.reshape(-1, NUM_TEST).mean(axis=0).tolist(),
        "predicted_mode_variance": (
          pred_var.reshape(-1, NUM_TEST).mean(axis=0) + pred_c.reshape(-1, NUM_TEST).var(axis=0)
        ).tolist(),
        "predicted_ensemble_variance": (
          pred_cross.mean(axis=0) + pred_c.mean(axis=1).var(axis=0)
        ).tolist(),
        "mode_variance_ratio_finite_time": mode_ratio,  # (value, jackknife standard error)
        "ensemble_variance_ratio_finite_time": ens_ratio,
        "k_times_ensemble_over_mode_variance": k_ratio,
        "mean_gap_over_se_rms": float(np.sqrt(np.mean((mean_gap / mean_se) ** 2))),
        # How far the finite-time prediction itself still is from Theorem 4.2's t = inf variance.
        "predicted_over_thm42_mode_variance": float(pred_mode(pred_c, pred_var) / var.mean()),
        "mode_variance_ratio": float(preds.reshape(-1, NUM_TEST).var(axis=0).mean() / var.mean()),
        "ensemble_variance_times_K_ratio": float(k * ensemble.var(axis=0).mean() / var.mean()),
        "train_rmse": float(np.sqrt(np.mean(fit**2))),
        "seconds": time.perf_counter() - t0,
      }
    )
    r = rows[-1]
    pm = lambda pair: f"{pair[0]:.3f} +- {pair[1]:.3f}"
    print(
      f"width {width}, K={k}: mode variance / finite-time prediction = {pm(mode_ratio)}; "
      f"ensemble variance / prediction = {pm(ens_ratio)}; K * ensemble / mode variance = {pm(k_ratio)}; "
      f"mean gap (rms, in SEs) = {r['mean_gap_over_se_rms']:.2f}; "
      f"prediction / Thm 4.2 {r['predicted_over_thm42_mode_variance']:.3f}; "
      f"vs Thm 4.2 (t = inf): mode {r['mode_variance_ratio']:.3f}, K * ensemble "
      f"{r['ensemble_variance_times_K_ratio']:.3f}; train rmse {r['train_rmse']:.4f} ({r['seconds']:.0f}s)",
      flush=True,
    )
  extrapolated = {
    k: infinite_width_limit([r for r in rows if r["K"] == k]) for k in map(int, _MODES.value)
  }
  for k, fit in extrapolated.items():
    if fit is not None:
      print(
        f"K={k}: mode variance / prediction extrapolated to m = inf (a + b / sqrt(m)): "
        f"{fit['intercept']:.3f} +- {fit['intercept_se']:.3f} (b = {fit['slope']:.1f})",
        flush=True,
      )
  result = {
    "settings": {
      "widths": [int(w) for w in _WIDTHS.value],
      "seeds": _SEEDS.value,
      "rounds": _ROUNDS.value,
      "tau": _TAU.value,
      "lr": _LR.value,
      "clients": NUM_CLIENTS,
      "points_per_client": POINTS,
      "s_w": S_W,
      "s_b": S_B,
    },
    "gp_mean": mean.tolist(),
    "gp_variance": var.tolist(),
    "rows": rows,
    "infinite_width_extrapolation": {str(k): v for k, v in extrapolated.items()},
  }
  with open(os.path.join(out_dir, "ntk_check.json"), "w") as f:
    json.dump(result, f, indent=2)
  _plot(result, os.path.join(out_dir, "ntk_check.png"))
  return result


def _plot(result, path):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for row in result["rows"]:
    axes[0].scatter(
      row["predicted_mode_variance"],
      row["mode_variance"],
      s=10,
      label=f"K={row['K']}, m={row['width']}",
    )
  top = max(max(max(r["mode_variance"]), max(r["predicted_mode_variance"])) for r in result["rows"])
  lim = [0, 1.1 * top]
  axes[0].plot(lim, lim, "k--", lw=1)
  axes[0].set(
    xlabel="predicted variance (linearised network, finite t)",
    ylabel="variance of the modes' predictions",
    title="per-mode spread vs finite-time NTK-GP",
  )
  axes[0].legend(fontsize=7)
  widest = [r for r in result["rows"] if r["width"] == max(result["settings"]["widths"])]
  ks = [r["K"] for r in widest]
  axes[1].loglog(
    ks, [np.mean(r["ensemble_variance"]) for r in widest], "-o", label="ensemble variance"
  )
  axes[1].loglog(
    ks,
    [np.mean(r["predicted_ensemble_variance"]) for r in widest],
    "s",
    mfc="none",
    label="finite-time prediction",
  )
  axes[1].loglog(
    ks, [np.mean(r["mode_variance"]) / r["K"] for r in widest], "k--", label="mode variance / K"
  )
  axes[1].set(
    xlabel="K",
    title=f"Cor. 4.1: variance of the K-mode average (m = {max(result['settings']['widths'])})",
  )
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  run(_OUT.value)


if __name__ == "__main__":
  app.run(main)
