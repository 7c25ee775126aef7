"""Privacy evaluation: SSIM/MSE, the receiver's view of a Jacobian, the DLG attack, the experiment script.

SSIM is checked against a numpy double loop over window positions written
from Wang et al. (2004) directly; the observation helper against numpy
argsort; the attack against the input it must recover on a tiny ReLU network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import jacobians, models, privacy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "privacy_attack.py")


# ----------------------------------------------------------------------------- SSIM / MSE


def ssim_brute_force(x, y, size=11, sigma=1.5, data_range=1.0, k1=0.01, k2=0.03):
  """Wang et al. (2004) SSIM, one window position at a time, float64."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  offsets = np.arange(size) - (size - 1) / 2
  w = np.exp(-(offsets[:, None] ** 2 + offsets[None, :] ** 2) / (2 * sigma**2))
  w /= w.sum()
  c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
  values = []
  for i in range(x.shape[0] - size + 1):
    for j in range(x.shape[1] - size + 1):
      a, b = x[i : i + size, j : j + size], y[i : i + size, j : j + size]
      mu_a, mu_b = (w * a).sum(), (w * b).sum()
      var_a, var_b = (w * (a - mu_a) ** 2).sum(), (w * (b - mu_b) ** 2).sum()
      cov = (w * (a - mu_a) * (b - mu_b)).sum()
      values.append(
        (2 * mu_a * mu_b + c1) * (2 * cov + c2) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
      )
  return float(np.mean(values))


def test_gaussian_window_matches_formula():
  w = np.asarray(privacy.gaussian_window(11, 1.5))
  r = np.arange(11) - 5
  ref = np.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * 1.5**2))
  np.testing.assert_allclose(w, ref / ref.sum(), rtol=1e-5)  # float32 exp: a few ulps
  assert w.shape == (11, 11) and abs(w.sum() - 1) < 1e-6


@pytest.mark.parametrize("shape,size,sigma", [((14, 13), 11, 1.5), ((9, 12), 7, 1.0)])
def test_ssim_matches_brute_force(shape, size, sigma):
  rng = np.random.default_rng(0)
  x = rng.uniform(size=shape)
  # y: a noisy, dimmed copy so SSIM is far from both 0 and 1 and every term matters.
  y = np.clip(0.7 * x + 0.1 + 0.15 * rng.normal(size=shape), 0, 1)
  got = float(privacy.ssim(x, y, window_size=size, sigma=sigma))
  want = ssim_brute_force(x, y, size, sigma)
  assert 0.1 < want < 0.9
  assert got == pytest.approx(want, abs=2e-5)  # float32 moments of values in [0, 1]
  # data_range enters C1, C2: pixel units [0, 255] with L = 255 give the same SSIM.
  assert float(
    privacy.ssim(255 * x, 255 * y, data_range=255.0, window_size=size, sigma=sigma)
  ) == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("size,sigma,data_range", [(11, 1.5, 1.0), (7, 1.0, 255.0)])
def test_ssim_equals_dm_pix(size, sigma, data_range):
  # DeepMind's image library computes the same SSIM (a 1-D separable Gaussian filter, channels last).
  import dm_pix  # pylint: disable=import-outside-toplevel -- a test dependency (setup.cfg [test])

  rng = np.random.default_rng(3)
  x = data_range * rng.uniform(size=(4, 28, 28))
  y = np.clip(0.6 * x + 0.2 * data_range * rng.uniform(size=x.shape), 0, data_range)
  got = np.asarray(privacy.ssim(x, y, data_range=data_range, window_size=size, sigma=sigma))
  want = np.asarray(
    dm_pix.ssim(
      jnp.asarray(x[..., None], jnp.float32),
      jnp.asarray(y[..., None], jnp.float32),
      max_val=data_range,
      filter_size=size,
      filter_sigma=sigma,
    )
  )
  assert np.all((0.1 < want) & (want < 0.95))
  np.testing.assert_allclose(got, want, atol=2e-6)  # float32 filters summed in different orders


def test_ssim_identity_symmetry_and_batch():
  rng = np.random.default_rng(1)
  x, y = rng.uniform(size=(2, 3, 12, 12)), rng.uniform(size=(2, 3, 12, 12))
  np.testing.assert_allclose(privacy.ssim(x, x), np.ones((2, 3)), atol=1e-6)
  batched = np.asarray(privacy.ssim(x, y))
  assert batched.shape == (2, 3)
  np.testing.assert_allclose(batched, np.asarray(privacy.ssim(y, x)), atol=1e-6)
  np.testing.assert_allclose(batched[1, 2], ssim_brute_force(x[1, 2], y[1, 2]), atol=2e-5)


def test_mse_per_image():
  rng = np.random.default_rng(2)
  x, y = rng.normal(size=(4, 5, 6)), rng.normal(size=(4, 5, 6))
  np.testing.assert_allclose(privacy.mse(x, y), ((x - y) ** 2).mean(axis=(1, 2)), rtol=1e-6)


def test_metric_errors():
  with pytest.raises(ValueError, match="same shape"):
    privacy.ssim(np.zeros((12, 12)), np.zeros((12, 13)))
  with pytest.raises(ValueError, match="window_size=11"):
    privacy.ssim(np.zeros((10, 12)), np.zeros((10, 12)))
  with pytest.raises(ValueError, match="data_range"):
    privacy.ssim(np.zeros((12, 12)), np.zeros((12, 12)), data_range=0.0)
  with pytest.raises(ValueError, match="same shape"):
    privacy.mse(np.zeros((3, 4)), np.zeros((4, 3)))


# ----------------------------------------------------------------------------- observation


def tiny_model(input_dim=6, hidden=5, classes=3, seed=0):
  model = models.mlp(input_dim=input_dim, hidden=(hidden,), num_classes=classes)
  return model, model.init(jax.random.PRNGKey(seed))


def test_sample_jacobian_is_forward_mode_jacobian():
  model, params = tiny_model()
  x = jax.random.normal(jax.random.key(3), (6,))
  flat, unravel = ravel_pytree(params)
  # Forward mode over the raveled parameters: an independent route to [C, d].
  want = jax.jacfwd(lambda w: model.apply(unravel(w), x))(flat)
  got = privacy.sample_jacobian(model.apply, params, x)
  assert got.shape == (3, flat.size)
  # Leaf order of ravel_pytree is that of jax.tree.leaves, the flat layout's order.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_observe_dense_and_topk_rows():
  rng = np.random.default_rng(4)
  jac = rng.normal(size=(3, 40)).astype(np.float32)
  dense = privacy.observe(jac)
  assert bool(jnp.all(dense.mask)) and np.array_equal(dense.jacobian, jac)
  obs = privacy.observe(jac, 0.25)
  mask, values = np.asarray(obs.mask), np.asarray(obs.jacobian)
  for c in range(3):
    top = np.argsort(-np.abs(jac[c]))[:10]  # ceil(0.25 * 40) = 10 per output row
    assert set(np.flatnonzero(mask[c])) == set(top)
  np.testing.assert_array_equal(values, np.where(mask, jac, 0))


def test_observe_quantises_kept_values_only():
  rng = np.random.default_rng(5)
  jac = rng.normal(size=(2, 50)).astype(np.float32)
  obs = privacy.observe(jac, 0.5, bits=4)
  mask = np.asarray(obs.mask)
  kept = jac[mask]
  step = (kept.max() - kept.min()) / 15
  assert np.all(np.abs(np.asarray(obs.jacobian)[mask] - kept) <= step / 2 + 1e-6)
  assert np.all(np.asarray(obs.jacobian)[~mask] == 0)
  assert len(np.unique(np.asarray(obs.jacobian)[mask])) <= 16


def test_observe_errors():
  with pytest.raises(ValueError, match="keep_fraction"):
    privacy.observe(np.zeros((2, 3), np.float32), 0.0)
  with pytest.raises(ValueError, match=r"\[C, d\]"):
    privacy.observe(np.zeros((1, 2, 3), np.float32))
  with pytest.raises(ValueError, match="bits"):
    privacy.observe(np.zeros((2, 3), np.float32), 0.5, bits=0)


def test_jacobian_distance_matches_numpy():
  rng = np.random.default_rng(6)
  target = rng.normal(size=(3, 20)).astype(np.float32)
  obs = privacy.observe(target, 0.3)
  dummy = rng.normal(size=(3, 20)).astype(np.float32)
  m = np.asarray(obs.mask)
  masked = np.where(m, dummy, 0).astype(np.float64)
  sent = np.asarray(obs.jacobian, np.float64)
  assert float(privacy.jacobian_distance(dummy, obs, "l2")) == pytest.approx(
    ((masked - sent) ** 2).sum(), rel=1e-5
  )
  cos = (masked * sent).sum() / np.linalg.norm(masked) / np.linalg.norm(sent)
  assert float(privacy.jacobian_distance(dummy, obs, "cosine")) == pytest.approx(1 - cos, abs=1e-6)
  # Entries outside the support do not count; a dummy equal to the truth has distance 0 either way.
  assert float(privacy.jacobian_distance(target, obs, "l2")) == 0.0
  assert abs(float(privacy.jacobian_distance(target, obs, "cosine"))) < 1e-6
  with pytest.raises(ValueError, match="distance"):
    privacy.jacobian_distance(dummy, obs, "l1")


# ----------------------------------------------------------------------------- attack


@pytest.mark.parametrize(
  "keep,distance,optimizer,steps,lr",
  [
    (1.0, "l2", "adam", 400, 0.1),
    (0.5, "l2", "adam", 400, 0.1),
    (1.0, "cosine", "adam", 400, 0.1),
    (0.5, "l2", "lbfgs", 60, 1.0),
  ],
)
def test_attack_recovers_tiny_input(keep, distance, optimizer, steps, lr):
  model, params = tiny_model()
  x = jax.random.normal(jax.random.key(7), (6,))
  # Every hidden unit must not be dead at x, or the first-layer block says nothing; check the premise.
  assert float(jnp.max(privacy.sample_jacobian(model.apply, params, x)[:, :30] ** 2)) > 0
  obs = privacy.observe(privacy.sample_jacobian(model.apply, params, x), keep)
  attack = privacy.make_attack(
    model.apply, params, (6,), steps=steps, learning_rate=lr, distance=distance, optimizer=optimizer
  )
  result = jax.jit(attack.run)(obs, jax.random.key(8))
  assert result.losses.shape == (steps,)
  assert float(result.losses[-1]) < 1e-3 * float(result.losses[0])
  np.testing.assert_allclose(result.x, x, atol=2e-3)


def test_attack_vmaps_over_samples_and_scale():
  """Per-sample attacks in one vmap; ``scale`` sets the dummy's size (here inputs of size ~5)."""
  model, params = tiny_model(seed=1)
  xs = 5.0 * jax.random.normal(jax.random.key(9), (3, 6))
  obs = jax.vmap(lambda x: privacy.observe(privacy.sample_jacobian(model.apply, params, x)))(xs)
  attack = privacy.make_attack(model.apply, params, (6,), steps=400, learning_rate=0.1, scale=5.0)
  state = attack.init(jax.random.key(0))
  assert state.u.shape == (6,)
  result = jax.jit(jax.vmap(attack.run))(obs, jax.random.split(jax.random.key(10), 3))
  np.testing.assert_allclose(result.x, xs, atol=1e-2)


def test_make_attack_errors():
  model, params = tiny_model()
  kwargs = dict(steps=10, learning_rate=0.1)
  with pytest.raises(ValueError, match="distance"):
    privacy.make_attack(model.apply, params, (6,), distance="l1", **kwargs)
  with pytest.raises(ValueError, match="optimizer"):
    privacy.make_attack(model.apply, params, (6,), optimizer="sgd", **kwargs)
  with pytest.raises(ValueError, match="steps"):
    privacy.make_attack(model.apply, params, (6,), steps=0, learning_rate=0.1)
  with pytest.raises(ValueError, match="learning_rate"):
    privacy.make_attack(model.apply, params, (6,), steps=10, learning_rate=-1.0)
  with pytest.raises(ValueError, match="scale"):
    privacy.make_attack(model.apply, params, (6,), scale=0.0, **kwargs)


# ----------------------------------------------------------------------------- projection


def test_unproject_is_min_norm_preimage():
  p = jacobians.projection_matrix(jax.random.key(11), 30, 8)
  rng = np.random.default_rng(12)
  x = rng.normal(size=(4, 30)).astype(np.float32)
  z = jacobians.project_inputs(x, p)
  x_hat = np.asarray(privacy.unproject(z, p))
  np.testing.assert_allclose(
    x_hat,
    np.asarray(z, np.float64) @ np.linalg.pinv(np.asarray(p, np.float64)),
    rtol=1e-4,
    atol=1e-4,
  )
  np.testing.assert_allclose(jacobians.project_inputs(x_hat, p), z, rtol=1e-4, atol=1e-4)
  # An input inside P's column space comes back exactly; the rest of x is lost.
  inside = np.asarray(p @ rng.normal(size=(8,)).astype(np.float32))
  np.testing.assert_allclose(
    privacy.unproject(jacobians.project_inputs(inside, p), p), inside, atol=1e-4
  )
  with pytest.raises(ValueError, match="d1' <= d1"):
    privacy.unproject(z, p.T)


# ----------------------------------------------------------------------------- the script


def run_script(tmp_path, *overrides):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, SCRIPT, f"--out_dir={tmp_path}", *overrides],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=600,
  )


def test_script_rejects_bad_config_before_work(tmp_path):
  proc = run_script(tmp_path, "--config.attack.distance=l1")
  assert proc.returncode != 0
  assert "config.attack.distance" in proc.stderr and "'l1'" in proc.stderr
  assert not os.listdir(tmp_path)


def test_script_smoke(tmp_path):
  """One image, a few steps: every output is written with the documented keys (real Fashion-MNIST files)."""
  proc = run_script(
    tmp_path,
    "--config.num_images=1",
    "--config.attack.steps=3",
    "--config.sweep=(1.0,)",
    "--config.proj_dim=20",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == [
    "privacy_attack.json",
    "privacy_attack.md",
    "privacy_attack.png",
    "privacy_attack_sparsity.png",
  ]
  with open(tmp_path / "privacy_attack.json") as f:
    summary = json.load(f)
  # The markdown (what ``ntk-fl reproduce ntk_fl:fig8`` renders) holds the JSON's means, rounded.
  table = (tmp_path / "privacy_attack.md").read_text()
  for name, entry in summary["results"].items():
    assert f"(`{name}`) | {entry['ssim_mean']:.3f} | {entry['mse_mean']:.4f} |" in table
  for point in summary["sweep"]:
    assert f"| {point['keep_fraction']:g} | {point['ssim_mean']:.3f} |" in table
  results = summary["results"]
  assert set(results) == {
    "dummy",
    "none",
    "sparse",
    "sparse_proj",
    "sparse_proj_key_leaked",
    "projection_limit",
  }
  for entry in results.values():
    assert len(entry["ssim"]) == 1 and -1 <= entry["ssim_mean"] <= 1 and entry["mse_mean"] >= 0
  assert (
    summary["num_params"] == 79_510 and summary["num_params_projected"] == 20 * 100 + 100 + 1010
  )
  # The curve holds the sweep's points and the figure's keep fraction, both reused, not re-attacked.
  assert [e["keep_fraction"] for e in summary["sweep"]] == [1.0, 0.25]
  assert summary["sweep"][0]["ssim_mean"] == results["none"]["ssim_mean"]
  assert summary["sweep"][1]["ssim_mean"] == results["sparse"]["ssim_mean"]
  assert "sweep_0.25" not in summary["timings_s"] and "sweep_1" not in summary["timings_s"]
