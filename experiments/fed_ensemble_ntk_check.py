"""NTK-regime check of Fed-ensemble (paper Sec. 4, Thm 4.2 / Cor. 4.1; fed_ensemble.md Sec. 3, 8.2).

Usage::

  python experiments/fed_ensemble_ntk_check.py --out=runs/fed_ensemble_ntk_check

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
(Cor. 4.1). Writes ``ntk_check.json`` and ``ntk_check.png``.
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

_OUT = flags.DEFINE_string("out", "runs/fed_ensemble_ntk_check", "output directory")
_WIDTH = flags.DEFINE_integer("width", 512, "hidden width m")
_SEEDS = flags.DEFINE_integer("seeds", 24, "independent runs per K")
_MODES = flags.DEFINE_list("modes", ["1", "4"], "numbers of modes K")
_ROUNDS = flags.DEFINE_integer("rounds", 1000, "communication rounds")
_TAU = flags.DEFINE_integer("tau", 8, "local GD steps per round")
_LR = flags.DEFINE_float("lr", 2.0, "local GD step")
_SEED = flags.DEFINE_integer("seed", 0, "seed of every draw")

S_W, S_B = 1.0, 0.3
NUM_CLIENTS, POINTS, NUM_TEST = 8, 2, 16


def make_data(seed):
  """Client ``i``'s 2 points lie on its own arc of the unit circle (non-iid in x); a test set all around."""
  rng = numpy_rng(seed, Stream.SYNTHETIC_DATA)
  angle = (np.arange(NUM_CLIENTS)[:, None] + rng.uniform(0, 1, (NUM_CLIENTS, POINTS))) * 2 * np.pi / NUM_CLIENTS
  x = np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32)                  # [N, n, 2]
  y = (np.sin(3 * angle) + 0.1 * rng.normal(size=angle.shape)).astype(np.float32)
  test_angle = rng.uniform(0, 2 * np.pi, NUM_TEST)
  x_test = (0.8 * np.stack([np.cos(test_angle), np.sin(test_angle)], -1)).astype(np.float32)
  return x, y, x_test


def kernels(x1, x2):
  """Analytic NNGP ``Kcal`` and NTK ``Theta`` of the network above (float64)."""
  x1, x2 = np.asarray(x1, np.float64), np.asarray(x2, np.float64)
  d = x1.shape[-1]
  k1 = lambda a, b: S_W ** 2 * a @ b.T / d + S_B ** 2
  k12, k11, k22 = k1(x1, x2), np.diag(k1(x1, x1)), np.diag(k1(x2, x2))
  norm = np.sqrt(np.outer(k11, k22))
  theta = np.arccos(np.clip(k12 / norm, -1.0, 1.0))
  relu_relu = norm / (2 * np.pi) * (np.sin(theta) + (np.pi - theta) * np.cos(theta))
  step_step = (np.pi - theta) / (2 * np.pi)
  nngp = S_W ** 2 * relu_relu + S_B ** 2
  return nngp, nngp + S_W ** 2 * k12 * step_step


def gp_posterior(x, y, x_test):
  """Thm 4.2's mean and variance at ``x_test`` from the pooled training data."""
  kxx, txx = kernels(x, x)
  ksx, tsx = kernels(x_test, x)
  kss, _ = kernels(x_test, x_test)
  a = np.linalg.solve(txx, tsx.T).T                                                     # Theta(x*,X) Theta^-1
  mean = a @ y
  var = np.diag(kss) + np.einsum("ij,jk,ik->i", a, kxx, a) - 2 * np.einsum("ij,ij->i", a, ksx)
  return mean, var


def init(key, width):
  k = jax.random.split(key, 4)
  return {"w": jax.random.normal(k[0], (width, 2)), "b1": jax.random.normal(k[1], (width,)),
          "v": jax.random.normal(k[2], (width,)), "b2": jax.random.normal(k[3], ())}


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
  rows = []
  for k in map(int, _MODES.value):
    t0 = time.perf_counter()
    assignment = np.stack([
        np.stack([fed_ensemble.round_modes(fed_ensemble.make_strata(NUM_CLIENTS, 0, 1000 * _SEED.value + s), k,
                                           1000 * _SEED.value + s, r) for r in range(_ROUNDS.value)])
        for s in range(_SEEDS.value)])                                                  # [S, rounds, N]
    keys = jax.vmap(lambda s: jax.random.split(jax.random.fold_in(jax_key(_SEED.value, Stream.ROUND_KEYS, k), s), k)
                    )(jnp.arange(_SEEDS.value))
    modes = jax.vmap(jax.vmap(lambda key: init(key, _WIDTH.value)))(keys)
    trained = jax.jit(jax.vmap(lambda m, a: train(m, x, y, a, _TAU.value, _LR.value)))(modes, assignment)
    preds = np.asarray(jax.vmap(jax.vmap(lambda p: apply(p, x_test)))(trained), np.float64)      # [S, K, T]
    fit = np.asarray(jax.vmap(jax.vmap(lambda p: apply(p, x.reshape(-1, 2))))(trained)) - y.reshape(-1)
    ensemble = preds.mean(axis=1)
    rows.append({
        "K": k,
        "mode_variance": preds.reshape(-1, NUM_TEST).var(axis=0).tolist(),
        "ensemble_variance": ensemble.var(axis=0).tolist(),
        "mode_mean": preds.reshape(-1, NUM_TEST).mean(axis=0).tolist(),
        "mode_variance_ratio": float(preds.reshape(-1, NUM_TEST).var(axis=0).mean() / var.mean()),
        "ensemble_variance_times_K_ratio": float(k * ensemble.var(axis=0).mean() / var.mean()),
        "train_rmse": float(np.sqrt(np.mean(fit ** 2))),
        "seconds": time.perf_counter() - t0,
    })
    r = rows[-1]
    print(f"K={k}: mean mode variance / GP variance = {r['mode_variance_ratio']:.3f}; "
          f"K * ensemble variance / GP variance = {r['ensemble_variance_times_K_ratio']:.3f}; "
          f"train rmse {r['train_rmse']:.4f} ({r['seconds']:.0f}s)", flush=True)
  result = {"settings": {"width": _WIDTH.value, "seeds": _SEEDS.value, "rounds": _ROUNDS.value, "tau": _TAU.value,
                         "lr": _LR.value, "clients": NUM_CLIENTS, "points_per_client": POINTS, "s_w": S_W,
                         "s_b": S_B},
            "gp_mean": mean.tolist(), "gp_variance": var.tolist(), "rows": rows}
  with open(os.path.join(out_dir, "ntk_check.json"), "w") as f:
    json.dump(result, f, indent=2)
  _plot(result, os.path.join(out_dir, "ntk_check.png"))
  return result


def _plot(result, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  gp = np.asarray(result["gp_variance"])
  for row in result["rows"]:
    axes[0].scatter(gp, row["mode_variance"], s=12, label=f"K={row['K']}")
  lim = [0, 1.1 * max(gp.max(), max(max(r["mode_variance"]) for r in result["rows"]))]
  axes[0].plot(lim, lim, "k--", lw=1)
  axes[0].set(xlabel="NTK-GP posterior variance k(x,x)", ylabel="variance of the modes' predictions",
              title="per-mode spread vs Thm 4.2")
  axes[0].legend(fontsize=8)
  ks = [r["K"] for r in result["rows"]]
  axes[1].loglog(ks, [np.mean(r["ensemble_variance"]) for r in result["rows"]], "-o", label="ensemble variance")
  axes[1].loglog(ks, [gp.mean() / k for k in ks], "k--", label="mean k(x,x) / K")
  axes[1].set(xlabel="K", title="Cor. 4.1: variance of the K-mode average")
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  run(_OUT.value)


if __name__ == "__main__":
  app.run(main)
