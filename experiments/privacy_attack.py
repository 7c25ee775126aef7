"""Gradient inversion (DLG) on transmitted Jacobians: NTK-DFL App. F / NTK-FL App. B.

  python experiments/privacy_attack.py [--out_dir=docs/figures] \
      [--config.dataset=mnist --config.num_images=6 --config.attack.steps=1000 ...]

A receiver (the NTK-FL server or an NTK-DFL neighbour) holds the round's weights
``w`` -- here the round-0 global model, ``model.init(jax.random.key(seed))`` exactly as
``ntk_fl.runner`` initialises a run -- and one client sample's Jacobian
``J(x) = ∂f(x; w)/∂w`` ``[C, d]``. It runs :func:`ntk_fl.privacy.make_attack`
on each of ``num_images`` training images (drawn from ``Stream.PRIVACY_ATTACK``)
under three settings:

* ``none``: the dense float32 Jacobian (NTK-FL / NTK-DFL without compression);
* ``sparse``: magnitude top-k of every output row, ``keep_fraction`` of the
  entries kept (NTK-DFL App. F: "sparsity 0.25"), optionally ``bits``-bit values;
* ``sparse_proj``: the same sparsification of the Jacobian of the network on
  CP-NTK-FL's projected inputs ``z = x P`` (``P [784, proj_dim]`` from
  ``Stream.INPUT_PROJECTION``, the first layer has ``proj_dim`` inputs).

What "reconstruction" means under projection: the attack recovers ``z``, the
network's actual input (``z_rel_err`` in the JSON). An image needs ``P``, which
only the clients hold (the trusted key server hands out its seed; NTK-FL §4.2).
The attacker knows how ``P`` is distributed, so the figure shows its best
guess: ``unproject(ẑ, P̃)`` with ``P̃`` an independent draw of the same
distribution (``Stream.PRIVACY_ATTACK`` index 2). The JSON also reports two
reference points: ``key_leaked`` (``unproject(ẑ, P)``: what the attacker would
see if the seed leaked) and ``projection_limit`` (``unproject(z, P)``: the most
any attacker can recover from ``z`` even with ``P``, since ``P`` discards
``784 − proj_dim`` input directions).

Metrics are computed on images in pixel units ``[0, 1]`` (de-standardised and
clipped): SSIM (Wang et al. 2004, Gaussian window 11, σ = 1.5) and MSE. The
``dummy`` entry scores the attack's random starting point as a chance level.
With ``sweep`` non-empty it also attacks the sparsified dense-input setting at
each of its keep fractions and ``keep_fraction`` (NTK-FL Fig. 8: SSIM vs sparsity).

Writes ``privacy_attack.png`` (rows: original, no compression, sparsified,
sparsified + projected; columns: images), ``privacy_attack_sparsity.png`` (the
sweep), ``privacy_attack.json`` and ``privacy_attack.md`` (mean SSIM and MSE per setting and
along the sweep) to ``--out_dir``.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import matplotlib
import ml_collections
import numpy as np
from ml_collections import config_flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend first)

from ntk_fl import compression, data, jacobians, models, privacy, validation  # noqa: E402
from ntk_fl.reproduce import scripted  # noqa: E402
from ntk_fl.rng import Stream, jax_key, numpy_rng  # noqa: E402

DATASETS = ("fashion_mnist", "mnist")
MODES = ("cp_ntk_fl", "ntk_dfl")
ROWS = (
  ("original", "original"),
  ("none", "no compression"),
  ("sparse", "sparsified"),
  ("sparse_proj", "sparsified + projected"),
)


def get_config() -> ml_collections.ConfigDict:
  """The figure's setting (every key is checked by :func:`validate_config` before any work)."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.dataset = "fashion_mnist"
  config.data_dir = ""
  config.num_images = 6
  config.hidden = (100,)  # the papers' 784-100-10 ReLU MLP
  config.keep_fraction = 0.25  # NTK-DFL App. F: "sparsity 0.25"
  config.bits = 32  # 32 = float32 values; fewer quantises the kept values
  config.proj_dim = 200  # NTK-DFL App. F / CP-NTK-FL Table 1: d1' = 200
  config.projection_scale = "sqrt_input"
  config.sweep = (1.0, 0.5, 0.1, 0.05, 0.01)  # extra keep fractions for the SSIM-vs-sparsity curve
  config.mode = "cp_ntk_fl"  # or "ntk_dfl": NTK-DFL's own compressed packages (Fig. 17)
  config.ntk_dfl = ml_collections.ConfigDict()
  config.ntk_dfl.package_size = 40  # the sender's samples in one package (200 / m2 = 5, App. E.3)
  config.ntk_dfl.bits = 6  # App. E.3's quantisation of the "bits" setting
  config.attack = ml_collections.ConfigDict()
  config.attack.steps = 1000
  config.attack.learning_rate = 0.1
  config.attack.distance = "l2"
  config.attack.optimizer = "adam"
  return config


_CONFIG = config_flags.DEFINE_config_dict(
  "config", get_config(), "Attack setting; override with --config.key=value."
)
_OUT_DIR = flags.DEFINE_string(
  "out_dir", "docs/figures", "Folder receiving the PNGs and privacy_attack.json."
)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ``ValueError`` naming the first bad key (before any data is loaded)."""
  validation.check_int("config.seed", config.seed, low=0)
  validation.check_choice("config.dataset", config.dataset, DATASETS)
  if not isinstance(config.data_dir, str):
    raise ValueError(
      f"config.data_dir must be a string ('' = default search path), got {config.data_dir!r}"
    )
  validation.check_int("config.num_images", config.num_images, low=1, high=64)
  for width in config.hidden:
    validation.check_int("config.hidden entry", width, low=1)
  validation.check_real("config.keep_fraction", config.keep_fraction, 0.0, 1.0, low_open=True)
  for fraction in config.sweep:
    validation.check_real("config.sweep entry", fraction, 0.0, 1.0, low_open=True)
  if config.bits != compression.FLOAT_BITS:
    validation.check_int("config.bits", config.bits, low=1, high=16)
  validation.check_int("config.proj_dim", config.proj_dim, low=1, high=783)
  validation.check_choice(
    "config.projection_scale", config.projection_scale, jacobians.PROJECTION_SCALES
  )
  validation.check_choice("config.mode", config.mode, MODES)
  validation.check_int(
    "config.ntk_dfl.package_size", config.ntk_dfl.package_size, low=config.num_images, high=256
  )
  validation.check_int("config.ntk_dfl.bits", config.ntk_dfl.bits, low=1, high=16)
  validation.check_int("config.attack.steps", config.attack.steps, low=1)
  validation.check_real(
    "config.attack.learning_rate", config.attack.learning_rate, 0.0, low_open=True
  )
  validation.check_choice("config.attack.distance", config.attack.distance, privacy.DISTANCES)
  validation.check_choice("config.attack.optimizer", config.attack.optimizer, privacy.OPTIMIZERS)


# ---------------------------------------------------------------------------- pieces


def load_images(config, count=None):
  """``count`` (default ``num_images``) training images.

  Returns ``(x [n, 784] standardised, pixels [n, 28, 28] in [0, 1], mean, std)``.
  """
  data_dir = config.data_dir or None
  standardised = data.load(config.dataset, data_dir)
  raw = data.load(config.dataset, data_dir, normalize=False)
  idx = numpy_rng(config.seed, Stream.PRIVACY_ATTACK, 0).choice(
    len(raw.y_train), count or config.num_images, replace=False
  )
  x, pixels = standardised.x_train[idx], raw.x_train[idx]
  # The loader's affine standardisation, read back from the two views (x = (pixel - mean) / std).
  std, mean = np.polyfit(x.reshape(-1), pixels.reshape(-1), 1)
  return jnp.asarray(x), pixels.reshape(-1, 28, 28), float(mean), float(std)


def attack_all(config, model, params, inputs, keep_fraction, key, scale=1.0):
  """Observes every sample's (compressed) Jacobian and inverts it; reconstructions ``[n, *in]``."""
  jac = jacobians.flat_jacobian(model.apply, params, inputs)  # [n, C, d]
  observations = jax.vmap(lambda j: privacy.observe(j, keep_fraction, config.bits))(jac)
  return invert(config, model, params, observations, key, scale)


def invert(config, model, params, observations, key, scale=1.0):
  """Inverts every observation (leaves ``[n, C, d]``); reconstructions ``[n, *in]`` and final losses."""
  attack = privacy.make_attack(
    model.apply,
    params,
    model.input_shape,
    steps=config.attack.steps,
    learning_rate=config.attack.learning_rate,
    distance=config.attack.distance,
    optimizer=config.attack.optimizer,
    scale=scale,
  )
  keys = jax.random.split(key, observations.jacobian.shape[0])
  result = jax.jit(jax.vmap(attack.run))(observations, keys)
  return result.x, result.losses[:, -1]


def to_pixels(x, mean, std):
  return np.clip(np.asarray(x).reshape(-1, 28, 28) * std + mean, 0.0, 1.0)


def scores(recon_pixels, pixels):
  return {
    "ssim": np.asarray(privacy.ssim(recon_pixels, pixels)).tolist(),
    "mse": np.asarray(privacy.mse(recon_pixels, pixels)).tolist(),
  }


def summarize(entry):
  return {
    **entry,
    "ssim_mean": float(np.mean(entry["ssim"])),
    "mse_mean": float(np.mean(entry["mse"])),
  }


# ---------------------------------------------------------------------------- experiment


def run(config, out_dir: str) -> dict:
  """The whole experiment; returns (and writes) the JSON results."""
  if config.mode == "ntk_dfl":
    return run_ntk_dfl(config, out_dir)
  x, pixels, mean, std = load_images(config)
  n, d1 = x.shape
  seed = config.seed
  attack_key = jax_key(seed, Stream.PRIVACY_ATTACK, 1)
  model = models.mlp(d1, tuple(config.hidden), 10)
  params = model.init(jax.random.key(seed))  # the round-0 global model of a run with this seed
  images, results = {"original": pixels}, {}
  timings = {}

  def timed(name, fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    timings[name] = round(time.perf_counter() - start, 1)
    logging.info("%s: %.1fs", name, timings[name])
    return out

  # The dummy's starting point (u ~ N(0, 1) with the key every setting uses) as a chance level.
  dummy = jax.vmap(lambda k: jax.random.normal(k, (d1,)))(jax.random.split(attack_key, n))
  results["dummy"] = summarize(scores(to_pixels(dummy, mean, std), pixels))

  for name, keep in (("none", 1.0), ("sparse", config.keep_fraction)):
    recon, final_loss = timed(name, lambda: attack_all(config, model, params, x, keep, attack_key))
    images[name] = to_pixels(recon, mean, std)
    results[name] = summarize(
      {
        "keep_fraction": keep,
        **scores(images[name], pixels),
        "input_rel_err": np.asarray(_rel_err(recon, x)).tolist(),
        "final_loss": np.asarray(final_loss).tolist(),
      }
    )

  # CP-NTK-FL: the network sees z = x P; the attacker inverts that network, then needs P for an image.
  projection = jacobians.projection_matrix(
    jax_key(seed, Stream.INPUT_PROJECTION), d1, config.proj_dim, scale=config.projection_scale
  )
  guess = jacobians.projection_matrix(
    jax_key(seed, Stream.PRIVACY_ATTACK, 2), d1, config.proj_dim, scale=config.projection_scale
  )
  z = jacobians.project_inputs(x, projection)
  proj_model = models.mlp(config.proj_dim, tuple(config.hidden), 10)
  proj_params = proj_model.init(jax.random.key(seed))
  # The attacker knows P's distribution: with an unscaled P, z_j ~ N(0, |x|^2) has size ~ sqrt(d1).
  z_scale = 1.0 if config.projection_scale == "sqrt_input" else float(np.sqrt(d1))
  z_hat, final_loss = timed(
    "sparse_proj",
    lambda: attack_all(
      config, proj_model, proj_params, z, config.keep_fraction, attack_key, z_scale
    ),
  )
  images["sparse_proj"] = to_pixels(privacy.unproject(z_hat, guess), mean, std)
  results["sparse_proj"] = summarize(
    {
      "keep_fraction": config.keep_fraction,
      "proj_dim": config.proj_dim,
      **scores(images["sparse_proj"], pixels),
      "z_rel_err": np.asarray(_rel_err(z_hat, z)).tolist(),
      "final_loss": np.asarray(final_loss).tolist(),
    }
  )
  results["sparse_proj_key_leaked"] = summarize(
    scores(to_pixels(privacy.unproject(z_hat, projection), mean, std), pixels)
  )
  results["projection_limit"] = summarize(
    scores(to_pixels(privacy.unproject(z, projection), mean, std), pixels)
  )

  sweep = []
  # The figure's own keep fraction joins the curve (its attack is reused, not re-run).
  for keep in sorted(
    set(config.sweep) | ({config.keep_fraction} if config.sweep else set()), reverse=True
  ):
    if keep == 1.0 or keep == config.keep_fraction:  # already attacked above
      entry = results["none" if keep == 1.0 else "sparse"]
    else:
      recon, _ = timed(
        f"sweep_{keep:g}", lambda: attack_all(config, model, params, x, keep, attack_key)
      )
      entry = summarize(scores(to_pixels(recon, mean, std), pixels))
    sweep.append(
      {"keep_fraction": keep, "ssim_mean": entry["ssim_mean"], "mse_mean": entry["mse_mean"]}
    )

  summary = {
    "config": config.to_dict(),
    "num_params": models.num_params(params),
    "num_params_projected": models.num_params(proj_params),
    "results": results,
    "sweep": sorted(sweep, key=lambda e: -e["keep_fraction"]),
    "timings_s": timings,
  }
  scripted.write_result(out_dir, "privacy_attack", summary, summary_markdown(summary), _jsonable)
  plot_grid(images, results, os.path.join(out_dir, "privacy_attack.png"), config)
  if summary["sweep"]:
    plot_sweep(summary["sweep"], os.path.join(out_dir, "privacy_attack_sparsity.png"), config)
  return summary


NTK_DFL_ROWS = (
  ("original", "original"),
  ("none", "no compression"),
  ("topk", "top-k"),
  ("bits", "quantised"),
  ("topk_bits", "top-k + quantised"),
  ("topk_proj", "top-k + projected"),
)


def run_ntk_dfl(config, out_dir: str) -> dict:
  """NTK-DFL Fig. 17: the attack on what an NTK-DFL sender transmits (App. E.3 packages).

  The sender holds ``ntk_dfl.package_size`` training images (the first ``num_images`` are attacked)
  and sends their Jacobians at the receiver's weights as one package per parameter tensor
  (:func:`ntk_fl.privacy.ntk_dfl_observations`): uncompressed, top-k ``keep_fraction`` per package
  tensor, ``ntk_dfl.bits``-bit values, and top-k on the network of projected inputs ``z = x P``
  (``proj_dim``; P from the run seed's ``INPUT_PROJECTION`` stream, as ``ntk_dfl``'s factory draws it);
  also top-k and ``bits`` together.
  Writes ``privacy_attack_ntk_dfl.json``, ``.md`` (the tables) and ``.png``.
  """
  x, pixels, mean, std = load_images(config, config.ntk_dfl.package_size)
  n, d1 = config.num_images, x.shape[1]
  pixels = pixels[:n]
  seed, keep, bits = config.seed, config.keep_fraction, config.ntk_dfl.bits
  attack_key = jax_key(seed, Stream.PRIVACY_ATTACK, 1)
  model = models.mlp(d1, tuple(config.hidden), 10)
  params = model.init(jax.random.key(seed))  # the receiver's weights: round 0 of a shared init
  images, results, timings = {"original": pixels}, {}, {}

  def victims(observation):  # the attacked samples' rows of the package
    return jax.tree.map(lambda a: a[:n], observation)

  dummy = jax.vmap(lambda k: jax.random.normal(k, (d1,)))(jax.random.split(attack_key, n))
  results["dummy"] = summarize(scores(to_pixels(dummy, mean, std), pixels))
  for name, k, b in (
    ("none", 1.0, 32),
    ("topk", keep, 32),
    ("bits", 1.0, bits),
    ("topk_bits", keep, bits),
  ):
    start = time.perf_counter()
    obs = victims(privacy.ntk_dfl_observations(model.apply, params, x, keep_fraction=k, bits=b))
    recon, final_loss = invert(config, model, params, obs, attack_key)
    timings[name] = round(time.perf_counter() - start, 1)
    images[name] = to_pixels(recon, mean, std)
    results[name] = summarize(
      {
        "keep_fraction": k,
        "bits": b,
        "kept_per_sample": np.asarray(obs.mask).mean(axis=(1, 2)).tolist(),
        **scores(images[name], pixels),
        "input_rel_err": np.asarray(_rel_err(recon, x[:n])).tolist(),
        "final_loss": np.asarray(final_loss).tolist(),
      }
    )
    logging.info("%s: SSIM %.3f (%.1fs)", name, results[name]["ssim_mean"], timings[name])

  projection = jacobians.projection_matrix(
    jax_key(seed, Stream.INPUT_PROJECTION), d1, config.proj_dim, scale=config.projection_scale
  )
  guess = jacobians.projection_matrix(
    jax_key(seed, Stream.PRIVACY_ATTACK, 2), d1, config.proj_dim, scale=config.projection_scale
  )
  z = jacobians.project_inputs(x, projection)
  proj_model = models.mlp(config.proj_dim, tuple(config.hidden), 10)
  proj_params = proj_model.init(jax.random.key(seed))
  z_scale = 1.0 if config.projection_scale == "sqrt_input" else float(np.sqrt(d1))
  start = time.perf_counter()
  obs = victims(privacy.ntk_dfl_observations(proj_model.apply, proj_params, z, keep_fraction=keep))
  z_hat, final_loss = invert(config, proj_model, proj_params, obs, attack_key, z_scale)
  timings["topk_proj"] = round(time.perf_counter() - start, 1)
  images["topk_proj"] = to_pixels(privacy.unproject(z_hat, guess), mean, std)
  results["topk_proj"] = summarize(
    {
      "keep_fraction": keep,
      "proj_dim": config.proj_dim,
      "kept_per_sample": np.asarray(obs.mask).mean(axis=(1, 2)).tolist(),
      **scores(images["topk_proj"], pixels),
      "z_rel_err": np.asarray(_rel_err(z_hat, z[:n])).tolist(),
      "final_loss": np.asarray(final_loss).tolist(),
    }
  )
  results["topk_proj_key_leaked"] = summarize(
    scores(to_pixels(privacy.unproject(z_hat, projection), mean, std), pixels)
  )
  results["projection_limit"] = summarize(
    scores(to_pixels(privacy.unproject(z[:n], projection), mean, std), pixels)
  )
  summary = {
    "config": config.to_dict(),
    "num_params": models.num_params(params),
    "num_params_projected": models.num_params(proj_params),
    "results": results,
    "timings_s": timings,
  }
  scripted.write_result(
    out_dir, "privacy_attack_ntk_dfl", summary, summary_markdown(summary), _jsonable
  )
  plot_grid(
    images,
    results,
    os.path.join(out_dir, "privacy_attack_ntk_dfl.png"),
    config,
    rows=NTK_DFL_ROWS,
    title=f"DLG on NTK-DFL packages ({config.ntk_dfl.package_size} samples), {config.dataset}, "
    f"init weights; top-k {keep:g} per package tensor, {bits} bits, d1'={config.proj_dim}",
  )
  return summary


RESULT_LABELS = {
  "dummy": "chance (the attack's random start)",
  **dict(ROWS[1:]),
  **dict(NTK_DFL_ROWS[1:]),
  "sparse_proj_key_leaked": "sparsified + projected, the secret P leaked",
  "topk_proj_key_leaked": "top-k + projected, the secret P leaked",
  "projection_limit": "the projection's limit (the true z unprojected with P)",
}


def summary_markdown(summary: dict) -> str:
  """The results as markdown tables: mean SSIM and MSE per setting, and the sparsity sweep."""
  lines = ["| setting | SSIM (mean) | MSE (mean) |", "|---|---:|---:|"]
  for name, entry in summary["results"].items():
    label = RESULT_LABELS.get(name, name)
    lines.append(f"| {label} (`{name}`) | {entry['ssim_mean']:.3f} | {entry['mse_mean']:.4f} |")
  if summary.get("sweep"):
    lines += ["", "| fraction kept | SSIM (mean) | MSE (mean) |", "|---:|---:|---:|"]
    lines += [
      f"| {e['keep_fraction']:g} | {e['ssim_mean']:.3f} | {e['mse_mean']:.4f} |"
      for e in summary["sweep"]
    ]
  return "\n".join(lines) + "\n"


def _rel_err(estimate, truth):
  return jnp.linalg.norm(estimate - truth, axis=-1) / jnp.linalg.norm(truth, axis=-1)


def _jsonable(value):
  if isinstance(value, (tuple, list)):
    return list(value)
  if isinstance(value, (np.floating, np.integer)):
    return value.item()
  raise TypeError(f"not JSON serialisable: {type(value)}")


def plot_grid(images, results, path, config, rows=ROWS, title=None):
  n = images["original"].shape[0]
  fig, axes = plt.subplots(len(rows), n, figsize=(1.3 * n + 1.6, 1.45 * len(rows)), squeeze=False)
  for r, (key, label) in enumerate(rows):
    for c in range(n):
      ax = axes[r, c]
      ax.imshow(images[key][c], cmap="gray", vmin=0, vmax=1)
      ax.set_xticks([])
      ax.set_yticks([])
      if key != "original":
        ax.set_title(f"SSIM {results[key]['ssim'][c]:.2f}", fontsize=7, pad=2)
    axes[r, 0].set_ylabel(label, fontsize=7)
  fig.suptitle(
    title
    or f"DLG on per-sample Jacobians, {config.dataset}, MLP 784-{'-'.join(map(str, config.hidden))}"
    f"-10 at init; keep {config.keep_fraction:g}, d1'={config.proj_dim}",
    fontsize=8,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  plt.close(fig)


def plot_sweep(sweep, path, config):
  keep = [e["keep_fraction"] for e in sweep]
  fig, ax = plt.subplots(figsize=(4, 3))
  ax.semilogx(keep, [e["ssim_mean"] for e in sweep], "o-")
  ax.set_xlabel("fraction kept (top-k per output row)")
  ax.set_ylabel("mean SSIM of reconstruction")
  ax.set_ylim(-0.05, 1.05)
  ax.grid(alpha=0.3)
  ax.set_title(f"DLG vs sparsification ({config.dataset})", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  config = _CONFIG.value
  try:
    validate_config(config)
  except ValueError as e:
    sys.exit(f"error: {e}")
  summary = run(config, _OUT_DIR.value)
  for name, entry in summary["results"].items():
    logging.info("%-24s SSIM %.3f  MSE %.4f", name, entry["ssim_mean"], entry["mse_mean"])


if __name__ == "__main__":
  app.run(main)
