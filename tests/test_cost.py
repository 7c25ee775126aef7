"""The cost estimate logged before round 1 (ntk_fl/_src/cost.py).

* The kernel FLOP count XLA reports for the MLP's structured kernel against its closed form.
* The workload (steps per round, kernel block) of each NTK method read from its smoke settings.
* The round estimate scales one calibrated step; a round over the budget is warned about, with advice.
"""

from __future__ import annotations

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import config as config_lib
from ntk_fl import models, schema, topology
from ntk_fl._src import cost
from ntk_fl._src.ntk_step import NTK_FUNCTIONS as NTK
from ntk_fl.algorithms import get_method, ntk_dfl
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


def _erdos_renyi_settings(variant="smoke", chunk=1, clients=40, method="ntk_dfl"):
  config = config_lib.load_config(method, variant)
  config.data.name = "synthetic"
  config.data.num_clients = clients
  config.topology.name = "erdos_renyi"
  config.topology.mean_degree = 5.0
  config.chunk_size = chunk
  return schema.validate_config(config)


@pytest.mark.parametrize("method", ["ntk_dfl", "spark"])
def test_an_erdos_renyi_round_is_costed_at_its_degree_groups_blocks(method):
  """Grouped (chunks of 1): the root mean square over round 0's clients of 1 + their group's slots, by a
  plain loop; padded (all clients at once, or compressed packages): k_max + 1 members."""
  fed = ragged_federation(np.random.default_rng(0), [9] * 40, dim=784, num_classes=10)
  model = models.mlp()
  grouped = _erdos_renyi_settings(method=method)
  graphs = grouped.built_topology
  groups = topology.degree_slot_groups(graphs)
  assert len(groups) > 1
  squares = []
  for degree in np.asarray(graphs.sample(0).mask).sum(axis=1):
    squares.append((1 + next(g for g in groups if g >= degree)) ** 2)
  work = cost.workload(grouped, model, fed)
  assert (work.steps, work.block) == (40, round(float(np.sqrt(np.mean(squares)))) * 9)
  assert work.block < (graphs.k_max + 1) * 9 / 2
  per_slot = "smoke,topk0.5" if method == "ntk_dfl" else "smoke,option_b"
  for padded in (
    _erdos_renyi_settings(chunk=0, method=method),
    _erdos_renyi_settings(per_slot, method=method),
  ):
    assert not padded.algorithm.any_slot_count or padded.chunk_size == 0
    assert cost.workload(padded, model, fed).block == (graphs.k_max + 1) * 9


def test_the_ntk_methods_hand_the_estimate_their_step_and_the_others_none():
  # The estimate imports no kernel code: a method whose rounds are NTK steps names them in its Method.
  for name in ("spark", "fed_ensemble"):
    assert get_method(name).ntk is NTK, name
  # NTK-FL's server and NTK-DFL's client add their explicit (transmitted-Jacobian) step and their
  # projected-input network.
  for name in ("ntk_fl", "ntk_dfl"):
    own = get_method(name).ntk
    assert own._replace(transmitted_step=None, projected_model=None) == NTK
    assert own.transmitted_step is not None and own.projected_model is models.mlp_on_inputs
  assert get_method("ntk_fl").ntk.transmitted_step is not get_method("ntk_dfl").ntk.transmitted_step
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


def test_scoring_flops_match_the_closed_form():
  """T candidate MLPs d-h-C scored on S samples: ``T·S·2·(d·h + h·C)`` for the two matrix products; the
  elementwise terms (biases, ReLU, log-softmax, the masked mean) are a few ``T·S·(h + C)``, under 2 %."""
  d, h, c, s, t = 200, 100, 10, 120, 7
  closed = t * s * 2 * (d * h + h * c)
  flops = cost.scoring_flops(models.mlp(d, (h,), c), s, t, ntk=NTK)
  assert flops == pytest.approx(closed, rel=0.02)
  assert flops >= closed
  assert cost.scoring_flops(models.mlp(d, (h,), c), 0, t, ntk=NTK) == 0.0


def test_explicit_jacobian_kernel_flops_match_the_closed_form():
  """Flat Jacobians [N, C, D] contracted, traced: ``2·N²·C·D`` for ``J Jᵀ``; building J (C backward passes
  per sample, ``≈ 4·N·C·D``) adds a few percent at N = 60."""
  d, h, c, n = 200, 100, 10, 60
  params = d * h + h + h * c + c
  closed = 2 * n * n * c * params
  flops = cost.kernel_flops(models.mlp(d, (h,), c), n, ntk=NTK, explicit=True)
  assert closed <= flops <= closed * 1.1
  assert flops > 5 * cost.kernel_flops(
    models.mlp(d, (h,), c), n, ntk=NTK
  )  # the structured kernel's is far less


def test_the_server_workload_follows_compression_and_validation_clients():
  from ntk_fl.algorithms import server_ntk

  fed = ragged_federation(np.random.default_rng(2), [7, 9, 5, 8] * 5, dim=784, num_classes=10)
  model = models.mlp()
  for variant in ("smoke", "smoke,table1", "smoke,validation", "smoke,table1,validation"):
    for name in ("ntk_fl", "cp_ntk_fl"):
      settings = _settings(name, variant)
      work = cost.workload(settings, model, fed)
      assert work.explicit == server_ntk.uses_explicit_jacobian(settings.algorithm)
      assert work.score_block == settings.algorithm.validation_clients * 9
      assert work.input_dim == settings.algorithm.projection_dim
  assert cost.workload(_settings("cp_ntk_fl", "smoke,table1,validation"), model, fed).explicit
  assert cost.workload(_settings("ntk_fl", "smoke,validation"), model, fed).score_block == 90


def _compressed_ntk_dfl():
  fed = ragged_federation(np.random.default_rng(4), [7, 9, 5, 8] * 5, dim=784, num_classes=10)
  settings = _settings("ntk_dfl", "smoke,topk0.5,bits6,proj20")
  return settings, fed, cost.workload(settings, models.mlp(), fed)


def test_a_compressing_ntk_dfl_client_is_costed_as_the_explicit_step_of_the_projected_mlp():
  """NTK-DFL with compressed packages (App. E.3) holds its neighbourhood's Jacobian explicitly: the
  workload is the explicit step of the d1'-wide MLP on k_max + 1 package slots. The input projection
  alone keeps the structured step, on the projected MLP."""
  settings, fed, work = _compressed_ntk_dfl()
  assert work.explicit and (work.keep_fraction, work.bits, work.input_dim) == (0.5, 6, 20)
  assert (work.packages, work.block) == (3, 3 * 9)  # smoke: degree 2, 9 samples a client
  projected_only = cost.workload(_settings("ntk_dfl", "smoke,proj20"), models.mlp(), fed)
  assert (projected_only.explicit, projected_only.input_dim, projected_only.packages) == (
    False,
    20,
    0,
  )
  plain = cost.workload(_settings("ntk_dfl"), models.mlp(), fed)
  assert (plain.explicit, plain.input_dim, plain.packages) == (False, 0, 0)


def test_the_calibrated_compressed_ntk_dfl_step_is_the_client_update():
  """The step the estimate times for a compressing NTK-DFL client gives the client update's new weights
  on the same neighbourhood block; its kernel FLOPs are the closed form ``2·N²·C·P`` of the d1'-wide MLP;
  a block too large to run whole is timed in whole package slots."""
  settings, fed, work = _compressed_ntk_dfl()
  model = models.mlp()
  ntk = get_method("ntk_dfl").ntk
  params_count = 20 * 100 + 100 + 100 * 10 + 10
  closed = 2 * work.block**2 * 10 * params_count
  # A block too large to run whole is timed in whole slots: 27 samples -> 12 (and 6 for the line).
  cal = cost.calibrate(model, work, ntk=ntk, max_flops=closed / 3)
  assert closed <= cal.kernel_flops <= 1.1 * closed
  assert (cal.block, cal.timed_block) == (27, 12) and cal.seconds > 0

  # The calibrated step against the client update of the run, on one neighbourhood block.
  projected = models.mlp_on_inputs(model, 20)
  params = projected.init(jax.random.key(0))
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((work.block, 20)), jnp.float32)
  hard = jax.nn.one_hot(rng.integers(0, 10, work.block), 10)
  mask = jnp.asarray(rng.random(work.block) > 0.2).at[0].set(True)
  update = ntk_dfl.make_client_update(projected, settings.algorithm, neighbourhood_slots=3)
  client_w, _ = jax.jit(update)(params, x[None], hard[None], mask[None], 0.01)
  no_scoring = cost._random_block(projected, 0, 0)
  delta = cost._step_fn(projected, work, ntk)(
    params, x, hard, mask, *no_scoring, jnp.ones((0,), bool)
  )
  estimated_w = jax.tree.map(jnp.add, params, delta)
  for got, want in zip(jax.tree.leaves(estimated_w), jax.tree.leaves(client_w)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert any(
    not np.allclose(a, b) for a, b in zip(jax.tree.leaves(client_w), jax.tree.leaves(params))
  )


def test_the_validation_estimate_exceeds_the_plain_one_by_the_scoring():
  """CP-NTK-FL's Table 1 server step with and without τ scored on the validation clients: the same kernel
  (explicit Jacobians of the projected MLP), plus the T candidates' forward passes on the validation block
  (FLOPs as the closed form of the scoring, against the server's d1'-wide MLP) and that block's memory."""
  fed = ragged_federation(np.random.default_rng(3), [7, 9, 5, 8] * 5, dim=784, num_classes=10)
  model = models.mlp()
  plain_settings = _settings("cp_ntk_fl", "smoke,table1")
  val_settings = _settings("cp_ntk_fl", "smoke,table1,validation")
  from ntk_fl.algorithms import server_ntk

  plain = cost.estimate(plain_settings, model, fed, ntk=server_ntk.METHOD.ntk)
  val = cost.estimate(val_settings, model, fed, ntk=server_ntk.METHOD.ntk)
  algo = val_settings.algorithm
  d1, t, s = algo.projection_dim, len(algo.taus), algo.validation_clients * 9
  assert plain.workload.explicit and val.workload.explicit
  assert plain.kernel_flops == val.kernel_flops
  assert plain.kernel_flops >= 2 * plain.workload.block**2 * 10 * (d1 * 100 + 100 + 1_010)
  assert plain.scoring_flops == 0.0
  closed = t * s * 2 * (d1 * 100 + 100 * 10)
  assert val.scoring_flops == pytest.approx(closed, rel=0.02) and val.scoring_flops >= closed
  # Its arguments grow by the validation block (inputs, one-hot targets, mask); XLA may lay the temporaries
  # out differently, so only the total's direction is certain.
  assert val.calibration.step_bytes > plain.calibration.step_bytes
  assert val.peak_bytes > plain.peak_bytes


def test_the_explicit_step_time_is_extrapolated_through_two_blocks():
  assert cost._extrapolate((10, 10 * 2.0 + 100 * 0.5), (20, 20 * 2.0 + 400 * 0.5), 80) == (
    pytest.approx(80 * 2.0 + 6400 * 0.5)
  )
  assert cost._extrapolate((10, 5.0), (20, 4.0), 40) == pytest.approx(8.0)  # b < 0: linear only
  assert cost._extrapolate((10, 1.0), (20, 8.0), 40) == pytest.approx(32.0)  # a < 0: quadratic only


def test_cost_estimate_false_skips_it_and_changes_neither_the_results_nor_the_runs_identity(
  tmp_path, monkeypatch, caplog
):
  """NTK-DFL's smoke run, 1 round on synthetic data, with and without the estimate: only the run with it
  compiles a calibration step and logs the estimate; every logged number but the timings is the same, and
  each run's folder is the other config's run (resumed, grouped, tied to its checkpoints)."""
  from ntk_fl import rundir, runner  # pylint: disable=import-outside-toplevel

  calibrations = []
  calibrate = cost.calibrate
  monkeypatch.setattr(
    cost, "calibrate", lambda *a, **k: calibrations.append(a[1].block) or calibrate(*a, **k)
  )

  def config(estimate):
    c = config_lib.load_config("ntk_dfl", "smoke")
    c.data.name, c.data.max_train, c.data.max_test = "synthetic", 0, 0
    c.rounds, c.eval.selection, c.cost_estimate = 1, False, estimate
    return c

  runs = {}
  for estimate in (True, False):
    workdir = str(tmp_path / f"estimate_{estimate}")
    calibrations.clear()
    caplog.clear()
    with caplog.at_level("INFO"):
      runner.run(config(estimate), workdir)
    logged = [r.getMessage() for r in caplog.records if "cost estimate on" in r.getMessage()]
    runs[estimate] = workdir, len(calibrations), len(logged)
  assert runs[True][1:] == (1, 1) and runs[False][1:] == (0, 0)

  untimed = lambda workdir: [
    {k: v for k, v in line.items() if not k.endswith("time")}
    for line in rundir.read_metrics(workdir)
  ]
  assert untimed(runs[False][0]) == untimed(runs[True][0])
  stored = {e: rundir.read_config(workdir) for e, (workdir, _, _) in runs.items()}
  assert stored[False]["cost_estimate"] is False and stored[True]["cost_estimate"] is True
  assert rundir.setting_key(stored[False]) == rundir.setting_key(stored[True])
  assert rundir.run_identity(stored[False]) == rundir.run_identity(stored[True])
  for estimate in (True, False):  # the other config finds each run finished: nothing to resume
    other = schema.validate_config(config(not estimate))
    assert rundir.check_workdir(other, runs[estimate][0], resume=True) == 1
  # A config.json written before the switch existed ran the estimate.
  path = os.path.join(runs[False][0], rundir.CONFIG_FILE)
  with open(path, "w") as f:
    json.dump({k: v for k, v in stored[False].items() if k != "cost_estimate"}, f)
  assert rundir.read_config(runs[False][0])["cost_estimate"] is True
  with pytest.raises(ValueError, match=r"config.cost_estimate must be a bool, got 'no'"):
    schema.validate_config({**config(True).to_dict(), "cost_estimate": "no"})


def _spy_generic_kernels(monkeypatch) -> list:
  """Records ``(implementation, N1)`` for every generic kernel traced from now on."""
  from ntk_fl._src import kernels  # pylint: disable=import-outside-toplevel

  seen = []
  for impl, name in (("ntvp", "ntvp_kernel"), ("jacobian", "jacobian_implementation_kernel")):
    kernel = getattr(kernels, name)
    monkeypatch.setattr(
      kernels,
      name,
      lambda *a, _k=kernel, _i=impl, **kw: seen.append((_i, a[2].shape[0])) or _k(*a, **kw),
    )
  return seen


@pytest.mark.parametrize(
  "block", [200, 300]
)  # N² below and above 'ntvp''s bound of 256² sample pairs
def test_the_calibration_times_the_implementation_of_the_runs_kernel(block, monkeypatch):
  """A net without a DenseStack or flax layers, whose traced kernel 'auto' computes by 'ntvp' up to 256²
  sample pairs and by the Jacobian contraction above (one sample's forward FLOPs ≈ 2·d: no weight reuse),
  calibrated on a quarter of its block: the timed step's kernel takes the implementation of the run's
  step on the whole block, on both sides of the bound."""
  model = models.mlp(20, (16,), 10)._replace(dense_stack=None, flax_apply=None)
  options = dict(taus=(5, 10), loss="ce", solver="euler", kernel="traced", select="network")
  seen = _spy_generic_kernels(monkeypatch)
  params = model.init(cost.jax.random.key(0))
  x = np.zeros((block, 20), np.float32)
  y = np.eye(10, dtype=np.float32)[np.arange(block) % 10]
  run_step = lambda p, x, y, m: NTK.step(model.apply, p, x, y, m, lr=0.01, **options)[0]
  cost.jax.eval_shape(run_step, params, x, y, np.ones(block, bool))  # traced as a round traces it
  (run,) = set(seen)
  assert run == ("ntvp" if block**2 <= 256**2 else "jacobian", block)  # the rule of generic_choice

  seen.clear()
  work = cost.Workload(4, block, 1, options)
  full = cost.kernel_flops(model, block, ntk=NTK)
  cal = cost.calibrate(model, work, ntk=NTK, max_flops=full / 10)
  assert cal.timed_block == block // 4 and cal.kernel_flops == full
  # The timed block's step and FLOP count, and the whole block's (compiled for its memory): one routine.
  assert {impl for impl, _ in seen} == {run[0]}
  assert {n for _, n in seen} == {block, block // 4}
  assert cost.kernel_implementation(model, block, ntk=NTK) == run[0]


@pytest.mark.parametrize("flax_layers", [False, True])
def test_the_calibration_of_a_structured_kernel_is_unchanged(flax_layers):
  """The paper MLP (its DenseStack) and the same MLP through its flax layers only (the layer-wise kernel):
  'auto' resolved for the block names the structured kernel, and the calibrated step and kernel are the
  very programs they were under 'auto'."""
  model = models.mlp(20, (16,), 10)
  if flax_layers:
    model = model._replace(dense_stack=None)
  work = cost.Workload(
    4, 64, 1, dict(taus=(5, 10), loss="ce", solver="euler", kernel="traced", select="network")
  )
  impl = cost.kernel_implementation(model, 64, ntk=NTK)
  assert impl == "structured"
  params = model.init(cost.jax.random.key(0))
  x = np.zeros((64, 20), np.float32)
  y = np.eye(10, dtype=np.float32)[np.arange(64) % 10]
  args = (params, x, y, np.ones(64, bool), *(np.zeros((0, *s), np.float32) for s in ((20,), (10,))))
  args = (*args, np.ones(0, bool))
  text = lambda i: cost._step_fn(model, work, NTK, i).lower(*args).as_text()
  assert text(impl) == text("auto")
  assert cost.kernel_flops(model, 64, ntk=NTK, implementation=impl) == cost.kernel_flops(
    model, 64, ntk=NTK
  )
