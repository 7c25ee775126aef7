"""The cost estimate logged before round 1 (ntk_fl/_src/cost.py).

* The kernel FLOP count XLA reports for the MLP's structured kernel against its closed form.
* The workload (steps per round, kernel block) of each NTK method read from its smoke settings.
* The round estimate scales one calibrated step; a round over the budget is warned about, with advice.
"""

from __future__ import annotations

import flax.linen as nn
import numpy as np
import pytest

from ntk_fl import config as config_lib
from ntk_fl import models, schema
from ntk_fl._src import cost
from ntk_fl._src.ntk_step import NTK_FUNCTIONS as NTK
from ntk_fl.algorithms import get_method
from tests.federations import ragged_federation


@pytest.mark.parametrize("hidden, n", [((100,), 60), ((100,), 150), ((32,), 90)])
def test_mlp_kernel_flops_match_the_closed_form(hidden, n):
  """One hidden layer of width h on d inputs, C outputs, traced, x2 = x1 (sample count N):

  forward ``2·N·d·h``; Gram of the layer inputs ``2·N²·(d + h)``; Gram of the last hidden layer's
  output factor ``2·N²·h`` (the output layer's is the constant 1). The elementwise O(N²) terms
  (``+1``, ``⊙``, ``/C``, ``+``) are a few N², under 1 % here.
  """
  d, c = 784, 10
  (h,) = hidden
  closed = 2 * n * d * h + 2 * n * n * (d + h + h)
  flops = cost.kernel_flops(models.mlp(d, hidden, c), n, ntk=NTK)
  assert flops == pytest.approx(closed, rel=0.01)
  assert flops >= closed  # the closed form leaves out only the (positive) elementwise terms


def _settings(name, variant="smoke"):
  config = config_lib.load_config(name, variant)
  config.data.name = "synthetic"
  config.data.max_train = 0
  config.data.max_test = 0
  return schema.validate_config(config)


def test_workload_of_each_ntk_method():
  fed = ragged_federation(
    np.random.default_rng(0), [7, 9, 5, 8] * 5, dim=784, num_classes=10
  )  # M=20, n=9
  model = models.mlp()
  dfl = cost.workload(_settings("ntk_dfl"), model, fed)
  assert (dfl.steps, dfl.block) == (20, 3 * 9)  # smoke: degree 2, so k_max + 1 = 3 members
  assert dfl.options["taus"] == (50, 100, 200) and dfl.concurrent == 1
  batched = cost.workload(_settings("ntk_dfl", "smoke,batched,subsample"), model, fed)
  assert (batched.steps, batched.block) == (
    20 * 4,
    3 * 1,
  )  # ⌈⌈9/5⌉/4⌉ = 1 sample per member per block
  server = cost.workload(_settings("ntk_fl"), model, fed)
  assert (server.steps, server.block) == (1, 5 * 9)  # smoke: 5 participants pool their samples
  assert cost.workload(_settings("fedavg"), model, fed) is None
  ens = cost.workload(_settings("fed_ensemble", "smoke,ntk"), model, fed)
  run = _settings("fed_ensemble", "smoke,ntk")
  assert ens.steps == run.algorithm.num_modes
  assert ens.block == max(run.algorithm.clients_per_round // run.algorithm.num_modes, 1) * 9


def test_the_ntk_methods_hand_the_estimate_their_step_and_the_others_none():
  # The estimate imports no kernel code: a method whose rounds are NTK steps names them in its Method.
  for name in ("ntk_dfl", "spark", "ntk_fl", "fed_ensemble"):
    assert get_method(name).ntk is NTK, name
  for name in ("fedavg", "fedprox", "dfedavg", "qsgd"):
    assert get_method(name).ntk is None, name
  fed = ragged_federation(np.random.default_rng(2), [6] * 20, dim=784, num_classes=10)
  assert cost.estimate(_settings("ntk_dfl"), models.mlp(), fed, ntk=None) is None


def test_estimate_scales_the_calibrated_step_and_warns_over_budget(caplog):
  fed = ragged_federation(np.random.default_rng(1), [6] * 20, dim=784, num_classes=10)
  model = models.mlp()
  settings = _settings("ntk_dfl")
  est = cost.estimate(settings, model, fed, ntk=NTK)
  cal = est.calibration
  assert cal.block == 18 and cal.seconds > 0 and cal.step_bytes > 0
  assert est.round_seconds == pytest.approx(20 * cal.seconds)
  assert est.kernel_flops == pytest.approx(20 * cost.kernel_flops(model, 18, ntk=NTK))
  params = 79_510 * 4
  assert (
    est.peak_bytes == 1 * cal.step_bytes + 2 * 20 * params
  )  # chunk_size 1, two copies of the clients

  assert cost.report(est, model) is None  # seconds, far below 10 minutes
  with caplog.at_level("WARNING"):
    message = cost.report(est, model, budget_s=1e-9)  # a tiny fake budget
  assert message is not None and "a round is estimated at" in message
  assert any(message in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
  assert "smaller kernel block N = 18" in message
  assert ("a GPU" in message) == (cost.jax.default_backend() == "cpu")
  assert "structured kernel" not in message  # the MLP has it

  fake = cal._replace(seconds=60.0)
  slow = cost.estimate(settings, model, fed, calibration=fake)
  assert slow.round_seconds == 20 * 60.0
  batchwise = models.from_flax(nn.Dense(10), (784,), 10, per_sample=False)
  tips = cost.advice(slow, batchwise, platform="gpu")
  assert not any("GPU" in t for t in tips) and any(
    "config.model.per_sample=True" in t for t in tips
  )
  assert not any(
    "structured" in t for t in cost.advice(slow, models.cnn((28, 28, 1)), platform="gpu")
  )


def test_a_large_kernel_is_timed_on_a_smaller_block_and_scaled():
  model = models.mlp()
  work = cost.Workload(
    4, 64, 1, dict(taus=(5, 10), loss="ce", solver="euler", kernel="traced", select="network")
  )
  full = cost.kernel_flops(model, 64, ntk=NTK)
  cal = cost.calibrate(
    model, work, ntk=NTK, max_flops=full / 10
  )  # (N/2)² = a quarter, (N/4)² = 1/16 < 1/10
  assert cal.block == 64 and cal.timed_block == 16 and cal.kernel_flops == full
  whole = cost.calibrate(model, work, ntk=NTK)
  assert whole.timed_block == 64 and whole.step_bytes == cal.step_bytes  # memory of the full block
  assert cal.seconds > 0
