"""Fed-ensemble's straggler over-selection: select more clients, aggregate the first to finish.

Reference: the selected clients redrawn with numpy's generator of the participation stream, every client's
finishing time ``n_i · exp(σ z_i)`` computed in a Python loop, and the fastest kept by sorting (client, time)
pairs.
"""

from __future__ import annotations

import numpy as np
import pytest

from ntk_fl import rng, runner, schema
from ntk_fl.algorithms import fed_ensemble
from ntk_fl.config import load_config


def test_first_to_finish_keeps_the_fastest_by_a_hand_computed_latency():
  sizes = np.random.default_rng(0).integers(10, 200, size=40)
  for round_index in range(3):
    selected = np.sort(np.random.default_rng(round_index).choice(40, 13, replace=False))
    kept = fed_ensemble.first_to_finish(selected, sizes, 10, 0.5, seed=7, round_index=round_index)
    z = np.random.default_rng(np.random.SeedSequence([7, int(rng.Stream.STRAGGLERS), round_index]))
    z = z.standard_normal(13)
    times = [(float(sizes[c]) * float(np.exp(0.5 * zi)), c) for c, zi in zip(selected, z)]
    assert kept.tolist() == sorted(c for _, c in sorted(times)[:10])
    slowest_kept = max(t for t, c in times if c in kept)
    assert all(t >= slowest_kept for t, c in times if c not in kept)


def test_a_round_aggregates_only_the_first_to_finish():
  config = load_config("fed_ensemble", "smoke,stragglers")
  assert (config.algorithm.over_selected, config.algorithm.clients_per_round) == (8, 6)
  experiment = runner.build_experiment(config)
  algorithm, federation = experiment.algorithm, experiment.federation
  seen = set()
  for round_index in range(4):
    inputs = algorithm.round_inputs(round_index)
    selected = fed_ensemble.sample_participants(
      np.zeros(20, np.int32), 8, "uniform", config.seed, round_index
    )
    expected = fed_ensemble.first_to_finish(
      selected, np.asarray(federation.n), 6, 0.5, config.seed, round_index
    )
    np.testing.assert_array_equal(inputs.clients, expected)
    assert len(inputs.clients) == 6 and set(inputs.clients) <= set(selected)
    seen |= set(selected.tolist()) - set(inputs.clients.tolist())
  assert seen  # some selected clients were dropped as stragglers


def test_straggler_config_checks():
  config = load_config("fed_ensemble", "smoke")
  config.algorithm.over_selected = 5  # fewer than the 6 aggregated
  with pytest.raises(ValueError, match="clients_per_round < over_selected"):
    schema.validate_config(config)
  config.algorithm.over_selected = 30
  with pytest.raises(ValueError, match="num_clients"):
    schema.validate_config(config)
  config = load_config("fed_ensemble", "smoke,stragglers")
  config.algorithm.latency_sigma = -1.0
  with pytest.raises(ValueError, match="latency_sigma"):
    schema.validate_config(config)
