"""Fed-ensemble's toy regression (paper Sec. 5, Table 1): bias and variance against the number of modes K.

Usage::

  python experiments/fed_ensemble_toy.py --config=configs/fed_ensemble_toy.py --out=runs/fed_ensemble_toy

Setting (``configs/fed_ensemble_toy.py``): 50 clients with 2 points each,
``x ~ U[-1, 1]``, ``y = a_i sin(2 pi x) + eps`` (``a_i ~ N(1, 0.2^2)`` per client,
``eps ~ N(0, 0.2^2)``), so ``E[y | x] = sin(2 pi x)``; a linear model on 100
fixed RBF features ``exp(-(x - nu_k)^2 / (2 b^2))``, ``b = 0.08``, ``nu_k ~ U[-1, 1]``.
The training data and features are drawn once; every repetition re-draws the
K modes' initial weights and the Fed-ensemble schedule (strata = clients,
one permutation matrix per age of K rounds, full participation), trains with
``local_steps`` full-batch gradient steps per client and round on the half
squared error, averages each mode over the clients that trained it (Remark
3.1) and predicts with the mean of the K modes. K = 1 is FedAvg.

Over the repetitions, with ``h`` the ensemble prediction and ``hbar`` its mean
over repetitions, on an equispaced grid of x in [-1, 1] (eq. 3):
``bias = mean_x (sin(2 pi x) - hbar(x))^2``, ``variance = mean_x mean_rep (h - hbar)^2``.
Both are reported, and also ``sqrt(bias)``: the paper's "bias ~ 0.11" is
reproduced by the root-mean-square bias of a fit that is trained to its best
(docs/fed_ensemble.md, "Toy regression": a squared bias of 0.11 needs a
heavily underfit model, and then the bias is not flat in K). For K = 1 the
script also computes the exact (closed-form) FedAvg bias and variance, and
their curve against the number of rounds.

Writes ``toy.json`` (settings and one row per K), ``toy.md`` (the table beside
the paper's) and ``toy.png`` (bias/variance vs K; predictive bands for K = 1
and the largest K, as in Fig. 2).
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from ntk_fl.algorithms import fed_ensemble
from ntk_fl.rng import Stream, jax_key, numpy_rng

_CONFIG = config_flags.DEFINE_config_file(
  "config", "configs/fed_ensemble_toy.py", "toy regression config"
)
_OUT = flags.DEFINE_string("out", "runs/fed_ensemble_toy", "output directory")

# Table 1 of the paper, verbatim (bias, variance) for K = 1 (FedAvg), 2, 10, 20, 40.
PAPER = {
  1: (0.109, 0.0496),
  2: (0.117, 0.0115),
  10: (0.112, 0.0063),
  20: (0.113, 0.0045),
  40: (0.112, 0.0042),
}
# Training lengths (rounds) at which the exact FedAvg curve of bias and variance is recorded.
CURVE_ROUNDS = (
  1,
  2,
  3,
  4,
  5,
  6,
  8,
  10,
  15,
  20,
  30,
  40,
  60,
  80,
  120,
  160,
  240,
  320,
  640,
  1000,
  3000,
  10000,
)


def rbf_features(x, centres, bandwidth):
  """``[n] -> [n, F]`` features ``exp(-(x - nu_k)^2 / (2 b^2))``."""
  return jnp.exp(-jnp.square(x[:, None] - centres[None, :]) / (2.0 * bandwidth**2))


def make_data(config):
  """The fixed training set (``[N, n_i]`` x and y) and the RBF centres, from the config seed."""
  rng = numpy_rng(config.seed, Stream.SYNTHETIC_DATA)
  n, m = config.num_clients, config.points_per_client
  x = rng.uniform(-1.0, 1.0, size=(n, m))
  amplitude = rng.normal(1.0, config.amplitude_sd, size=(n, 1))
  y = amplitude * np.sin(2 * np.pi * x) + rng.normal(0.0, config.noise_sd, size=(n, m))
  centres = rng.uniform(-1.0, 1.0, size=config.num_features)
  return x.astype(np.float32), y.astype(np.float32), centres.astype(np.float32)


def schedules(config, num_modes: int) -> np.ndarray:
  """int32 ``[rounds, R, N]``: the mode each client trains, per round and repetition (full participation)."""
  out = np.empty((config.rounds, config.repetitions, config.num_clients), np.int32)
  for rep in range(config.repetitions):
    seed = config.seed * 100_003 + rep  # one schedule per repetition, all from the config seed
    strata = fed_ensemble.make_strata(config.num_clients, 0, seed)
    for r in range(config.rounds):
      out[r, rep] = fed_ensemble.round_modes(strata, num_modes, seed, r)
  return out


def train(config, phi, y, assignment, init):
  """Fed-ensemble on the linear model; returns the final modes ``[R, K, F]``.

  Args:
    phi: ``[N, n_i, F]`` client features; y: ``[N, n_i]``.
    assignment: ``[rounds, R, N]`` modes; init: ``[R, K, F]`` initial weights.
  """
  num_clients = phi.shape[0]

  def local(w, phi_i, y_i):  # full-batch GD on (1 / (2 n_i)) ||phi_i w - y_i||^2
    def step(w, _):
      return w - config.lr * phi_i.T @ (phi_i @ w - y_i) / phi_i.shape[0], None

    return jax.lax.scan(step, w, None, length=config.local_steps)[0]

  def one_rep(modes, assign):  # modes [K, F], assign [N]
    trained = jax.vmap(local)(modes[assign], phi, y)  # [N, F]
    new, _ = fed_ensemble.aggregate_modes(modes, trained, assign, jnp.ones(num_clients))
    return new

  def round_(modes, assign):
    return jax.vmap(one_rep)(modes, assign), None

  return jax.jit(lambda w0, a: jax.lax.scan(round_, w0, a)[0])(init, assignment)


def fedavg_closed_form(config, phi, y, phi_grid, truth, rounds):
  """Exact K = 1 (FedAvg) bias and variance after each of ``rounds`` (float64, no sampling).

  On a linear model a client's ``s`` GD steps are an affine map ``w -> A_i w +
  b_i``, so a FedAvg round (full participation, unweighted mean) is ``w ->
  Abar w + bbar`` and ``w_R = Abar^R w_0 + w_R(0)``. The mean over
  initialisations ``w_0 ~ N(0, init_std^2 I)`` is the run from zero (so the bias
  needs no repetitions) and the variance at ``x`` is ``init_std^2
  ||phi(x)^T Abar^R||^2``.

  Returns:
    ``{R: (bias, variance, train_mse of the mean)}`` for ``R`` in ``rounds``.
  """
  phi, y = np.asarray(phi, np.float64), np.asarray(y, np.float64)
  phi_grid = np.asarray(phi_grid, np.float64)
  num_features = phi.shape[-1]
  a_bar, b_bar = np.zeros((num_features, num_features)), np.zeros(num_features)
  for phi_i, y_i in zip(phi, y):
    step = np.eye(num_features) - config.lr * phi_i.T @ phi_i / phi_i.shape[0]
    a, b = np.eye(num_features), np.zeros(num_features)
    for _ in range(config.local_steps):
      a, b = step @ a, step @ b + config.lr * phi_i.T @ y_i / phi_i.shape[0]
    a_bar += a / phi.shape[0]
    b_bar += b / phi.shape[0]
  out, w, power = {}, np.zeros(num_features), np.eye(num_features)
  for r in range(1, max(rounds) + 1):
    w, power = a_bar @ w + b_bar, a_bar @ power
    if r in rounds:
      variance = config.init_std**2 * np.mean(np.sum((phi_grid @ power) ** 2, axis=1))
      out[r] = (
        float(np.mean((phi_grid @ w - truth) ** 2)),
        float(variance),
        float(np.mean((np.einsum("nif,f->ni", phi, w) - y) ** 2)),
      )
  return out


def bias_variance(predictions, truth):
  """``predictions [R, G]`` ensemble outputs on the grid; ``truth [G]``. Returns ``(bias, variance)``."""
  mean = predictions.mean(axis=0)
  return float(np.mean((truth - mean) ** 2)), float(np.mean((predictions - mean) ** 2))


def run(config, out_dir: str) -> dict:
  os.makedirs(out_dir, exist_ok=True)
  x, y, centres = make_data(config)
  phi = rbf_features(jnp.asarray(x.reshape(-1)), centres, config.bandwidth).reshape(*x.shape, -1)
  grid = np.linspace(-1.0, 1.0, config.grid, dtype=np.float32)
  phi_grid = rbf_features(jnp.asarray(grid), centres, config.bandwidth)
  truth = np.sin(2 * np.pi * grid)
  rows, bands = [], {}
  for k in config.modes:
    t0 = time.perf_counter()
    init = config.init_std * jax.random.normal(
      jax_key(config.seed, Stream.ROUND_KEYS, k), (config.repetitions, k, config.num_features)
    )
    modes = train(config, phi, jnp.asarray(y), jnp.asarray(schedules(config, k)), init)
    per_mode = np.asarray(jnp.einsum("gf,rkf->rkg", phi_grid, modes))  # [R, K, G]
    ensemble = per_mode.mean(axis=1)
    bias, variance = bias_variance(ensemble, truth)
    train_pred = np.asarray(jnp.einsum("nif,rkf->rkni", phi, modes)).mean(axis=1)
    rows.append(
      {
        "K": k,
        "bias": bias,
        "rms_bias": float(np.sqrt(bias)),
        "variance": variance,
        "single_mode_variance": float(np.mean(np.var(per_mode, axis=(0, 1)))),
        "train_mse": float(np.mean((train_pred - y) ** 2)),
        "paper_bias": PAPER.get(k, (None, None))[0],
        "paper_variance": PAPER.get(k, (None, None))[1],
        "seconds": time.perf_counter() - t0,
      }
    )
    bands[k] = per_mode[0], ensemble
    print(
      f"K={k:3d}  bias {bias:.4f}  variance {variance:.5f}  ({rows[-1]['seconds']:.1f}s)",
      flush=True,
    )
  curve = fedavg_closed_form(
    config, phi, y, phi_grid, truth, sorted(set(CURVE_ROUNDS) | {config.rounds})
  )
  exact = curve[config.rounds]
  print(
    f"K=1 exact (closed form, R = {config.rounds}): bias {exact[0]:.4f} (rms {np.sqrt(exact[0]):.4f})  "
    f"variance {exact[1]:.5f}",
    flush=True,
  )
  result = {
    "config": config.to_dict(),
    "rows": rows,
    "fedavg_exact": {"bias": exact[0], "rms_bias": float(np.sqrt(exact[0])), "variance": exact[1]},
    "fedavg_exact_by_rounds": [
      {"rounds": r, "bias": b, "rms_bias": float(np.sqrt(b)), "variance": v, "train_mse": m}
      for r, (b, v, m) in sorted(curve.items())
    ],
  }
  with open(os.path.join(out_dir, "toy.json"), "w") as f:
    json.dump(result, f, indent=2)
  lines = [
    "| K | bias = eq. (3), squared (ours) | sqrt(bias) (ours) | variance (ours) | bias (paper) | "
    "variance (paper) |",
    "|---|---|---|---|---|---|",
  ]
  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  for row in rows:
    lines.append(
      f"| {row['K']} | {row['bias']:.4f} | {row['rms_bias']:.3f} | {row['variance']:.4f} | "
      f"{fmt(row['paper_bias'], '.3f')} | {fmt(row['paper_variance'], '.4f')} |"
    )
  lines += [
    "",
    f"K = 1 exact (closed form): bias {exact[0]:.4f}, sqrt(bias) {np.sqrt(exact[0]):.3f}, "
    f"variance {exact[1]:.4f}.",
    "",
    "| rounds (K = 1, exact) | bias | sqrt(bias) | variance | train MSE |",
    "|---|---|---|---|---|",
  ]
  lines += [
    f"| {r} | {b:.4f} | {np.sqrt(b):.3f} | {v:.4f} | {m:.4f} |"
    for r, (b, v, m) in sorted(curve.items())
  ]
  with open(os.path.join(out_dir, "toy.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  _plot(rows, bands, grid, truth, x, y, os.path.join(out_dir, "toy.png"))
  return result


def _plot(rows, bands, grid, truth, x, y, path):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  ks = [r["K"] for r in rows]
  axes[0].plot(ks, [r["bias"] for r in rows], "-o", label="bias, eq. (3) (ours)")
  axes[0].plot(ks, [r["rms_bias"] for r in rows], "-o", label="sqrt(bias) (ours)")
  axes[0].plot(ks, [r["variance"] for r in rows], "-o", label="variance (ours)")
  paper = [(k, *PAPER[k]) for k in ks if k in PAPER]
  axes[0].plot([p[0] for p in paper], [p[1] for p in paper], "--x", label="bias (paper)")
  axes[0].plot([p[0] for p in paper], [p[2] for p in paper], "--x", label="variance (paper)")
  axes[0].set(xscale="log", yscale="log", xlabel="K (modes)", title="Table 1: bias and variance")
  axes[0].legend(fontsize=8)
  for ax, k in zip(axes[1:], (ks[0], ks[-1])):
    members, ensemble = bands[k]
    lo, hi = (
      np.percentile(members, [5, 95], axis=0) if members.shape[0] > 1 else (members[0], members[0])
    )
    ax.fill_between(grid, lo, hi, color="tab:green", alpha=0.3, label="modes (5-95%)")
    ax.plot(grid, ensemble[0], color="tab:blue", label="averaged")
    ax.plot(grid, truth, "k--", lw=1, label="sin(2 pi x)")
    ax.scatter(x[:10].ravel(), y[:10].ravel(), s=10, color="tab:red", label="data (10 clients)")
    ax.set(title=f"K = {k} (repetition 0)", xlabel="x", ylim=(-2, 2))
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  config = _CONFIG.value
  if config.method != "fed_ensemble_toy":
    raise ValueError(
      f"expected the toy config (configs/fed_ensemble_toy.py), got method {config.method!r}"
    )
  run(config, _OUT.value)


if __name__ == "__main__":
  app.run(main)
