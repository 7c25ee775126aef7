"""The attack's view of NTK-DFL's compressed payloads is exactly what the client update transmits.

``privacy.ntk_dfl_observations`` rebuilds one sender's package; the reference is the training code
itself: the NTK-DFL client update is run with :func:`ntk_fl.compression.compress_packages` wrapped
to record the arrays it hands to the kernel (the neighbours' transmitted packages), and every
sender's rows are compared with the observation of that sender's samples. The support is checked
against a numpy sort of each package tensor, and the projected setting against the federation the
NTK-DFL factory builds (same ``P``, same projected inputs).
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import compression, jacobians, models, privacy
from ntk_fl.algorithms import ntk_dfl
from ntk_fl.data import federation_from_padded
from ntk_fl.rng import Stream, jax_key

DIM, HIDDEN, CLASSES, SLOTS, N = 6, 5, 3, 3, 4  # 3 neighbourhood slots (own + 2 senders) of 4 rows


def hparams(keep, bits, projection_dim=0):
  return ntk_dfl.NTKDFLHParams(
    lr=0.1,
    lr_decay=0.0,
    taus=(1, 2),
    loss="ce",
    solver="euler",
    select="network",
    kernel="traced",
    per_round_averaging=True,
    jacobian_batches=1,
    subsample=1,
    sparsify_keep=keep,
    quantize_bits=bits,
    projection_dim=projection_dim,
  )


@pytest.mark.parametrize("keep, bits", [(0.25, 32), (1.0, 6), (0.25, 6)])
def test_observations_equal_the_packages_the_client_update_transmits(monkeypatch, keep, bits):
  model = models.mlp(DIM, (HIDDEN,), CLASSES)
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(SLOTS * N, DIM)).astype(np.float32)
  mask = np.ones(SLOTS * N, bool)
  mask[2 * N + 3] = False  # the last sender has 3 real rows and one padding slot
  x[~mask] = 0.0
  hard = jax.nn.one_hot(rng.integers(0, CLASSES, SLOTS * N), CLASSES)

  recorded = []
  real_compress = compression.compress_packages

  def recording(*args, **kwargs):
    out = real_compress(*args, **kwargs)
    recorded.append(out)
    return out

  monkeypatch.setattr(compression, "compress_packages", recording)
  update = ntk_dfl.make_client_update(model, hparams(keep, bits), neighbourhood_slots=SLOTS)
  update(params, jnp.asarray(x)[None], hard[None], jnp.asarray(mask)[None], jnp.float32(0.1))
  monkeypatch.undo()
  assert len(recorded) == 1
  transmitted = jacobians.flatten_jacobian(list(recorded[0]))  # [SLOTS * N, C, d]

  # The receiver's neighbourhood as the client update stacks it: the senders' rows bit for bit.
  obs = privacy.ntk_dfl_observations(
    model.apply, params, jnp.asarray(x), keep_fraction=keep, bits=bits, mask=mask, num_senders=SLOTS
  )
  np.testing.assert_array_equal(obs.jacobian[N:], transmitted[N:])  # slot 0 (own rows) is not sent
  raw = jax.tree.leaves(jacobians.per_sample_jacobian(model.apply, params, jnp.asarray(x)))
  for slot in range(1, SLOTS):
    rows = slice(slot * N, (slot + 1) * N)
    # The support: numpy's top ceil(keep * size) magnitudes of each package tensor's real rows.
    support = []
    for leaf in raw:
      real = mask[rows].reshape((-1,) + (1,) * (leaf.ndim - 1))
      leaf = np.where(real, np.asarray(leaf[rows]), 0.0)
      kept = np.broadcast_to(real, leaf.shape).ravel().copy()
      if keep < 1:
        k = max(1, math.ceil(keep * int(mask[rows].sum()) * math.prod(leaf.shape[1:]) - 1e-9))
        kept[:] = False
        kept[np.argsort(-np.abs(leaf.ravel()), kind="stable")[:k]] = True
      support.append(kept.reshape(leaf.shape))
    np.testing.assert_array_equal(obs.mask[rows], jacobians.flatten_jacobian(support))
    # One sender's package on its own (the attack script's call): the same up to float rounding
    # of a differently batched Jacobian, the same support.
    alone = privacy.ntk_dfl_observations(
      model.apply, params, jnp.asarray(x[rows]), keep_fraction=keep, bits=bits, mask=mask[rows]
    )
    np.testing.assert_array_equal(alone.mask, obs.mask[rows])
    # Quantised values share the package's min-max range, which moves by an ulp too.
    np.testing.assert_allclose(alone.jacobian, obs.jacobian[rows], rtol=1e-5, atol=1e-6)
  # Outside the support nothing is sent (padding rows are never sent: the quantiser may move them).
  off_support = ~np.asarray(obs.mask) & mask[:, None, None]
  assert not np.any(np.asarray(obs.jacobian)[off_support])


def test_projected_payload_is_taken_on_the_factorys_projected_inputs():
  model = models.mlp(DIM, (HIDDEN,), CLASSES)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 4, DIM)).astype(np.float32)
  fed = federation_from_padded(x, np.zeros((2, 4), np.int32), np.ones((2, 4), bool))
  projection, proj_model, proj_fed = ntk_dfl._project_federation(  # pylint: disable=protected-access
    model, fed, hparams(0.25, 32, projection_dim=4), seed=3
  )
  # What the attack script builds: CP-NTK-FL's P from the run seed, z = x P, the MLP on d1' inputs.
  ours = jacobians.projection_matrix(jax_key(3, Stream.INPUT_PROJECTION), DIM, 4)
  np.testing.assert_array_equal(projection, ours)
  z = jacobians.project_inputs(jnp.asarray(x.reshape(-1, DIM)), ours)
  # The same product x P over the padded [clients, slots, DIM] layout: equal up to the rounding of a
  # differently shaped matrix product (a few units in the last place of the largest entry on some CPUs).
  ulps = 4 * np.finfo(np.float32).eps * float(np.abs(z).max())
  np.testing.assert_allclose(np.asarray(proj_fed.x).reshape(-1, 4), z, rtol=0, atol=ulps)
  params = models.mlp(4, (HIDDEN,), CLASSES).init(jax.random.key(0))
  a = privacy.ntk_dfl_observations(proj_model.apply, params, z[:4], keep_fraction=0.25)
  b = privacy.ntk_dfl_observations(
    models.mlp(4, (HIDDEN,), CLASSES).apply, params, z[:4], keep_fraction=0.25
  )
  np.testing.assert_array_equal(a.jacobian, b.jacobian)


def test_script_ntk_dfl_mode_writes_its_settings(tmp_path):
  """A two-image package, a few steps (real Fashion-MNIST files): outputs and documented keys."""
  from test_privacy import run_script  # pylint: disable=g-import-not-at-top

  proc = run_script(
    tmp_path,
    "--config.mode=ntk_dfl",
    "--config.num_images=1",
    "--config.ntk_dfl.package_size=2",
    "--config.attack.steps=3",
    "--config.proj_dim=20",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == [
    "privacy_attack_ntk_dfl.json",
    "privacy_attack_ntk_dfl.md",
    "privacy_attack_ntk_dfl.png",
  ]
  with open(tmp_path / "privacy_attack_ntk_dfl.json") as f:
    results = json.load(f)["results"]
  table = (tmp_path / "privacy_attack_ntk_dfl.md").read_text()
  assert "fraction kept" not in table  # no sweep in this mode
  for name, entry in results.items():
    assert f"(`{name}`) | {entry['ssim_mean']:.3f} | {entry['mse_mean']:.4f} |" in table
  assert set(results) == {
    "dummy",
    "none",
    "topk",
    "bits",
    "topk_bits",
    "topk_proj",
    "topk_proj_key_leaked",
    "projection_limit",
  }
  assert results["none"]["kept_per_sample"] == [1.0] and results["bits"]["kept_per_sample"] == [1.0]
  assert results["bits"]["bits"] == 6 and results["topk"]["keep_fraction"] == 0.25
  assert 0 < results["topk"]["kept_per_sample"][0] < 1


def test_script_rejects_a_package_smaller_than_the_victims(tmp_path):
  from test_privacy import run_script  # pylint: disable=g-import-not-at-top

  proc = run_script(tmp_path, "--config.num_images=4", "--config.ntk_dfl.package_size=2")
  assert proc.returncode != 0 and "config.ntk_dfl.package_size" in proc.stderr
  assert not os.listdir(tmp_path)
