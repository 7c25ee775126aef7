"""Fed-ensemble's toy regression (Shi et al., Sec. 5, Table 1), run by ``experiments/fed_ensemble_toy.py``.

Not a federated run of ``experiments/main.py``: the script fits K modes of a
random-features regression with closed-form local steps and reports bias and
variance against K. ``--config=configs/fed_ensemble_toy.py`` (no variants;
override fields with ``--config.<key>=value``).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Table 1's toy regression (Sec. 5): 50 clients x 2 points, 100 fixed RBF features, b = 0.08.

  Stated by the paper: clients, points, features, bandwidth, noise sd 0.2,
  client amplitude ~ N(1, 0.2^2), 100 repetitions, K in {1, 2, 10, 20, 40}.
  Chosen here (the paper gives none): full participation, each client its own
  stratum, ``local_steps`` full-batch GD steps of ``lr`` per round on the
  half squared error, ``rounds`` rounds, initial weights ~ N(0, init_std^2),
  bias and variance averaged over ``grid`` equispaced x in [-1, 1].

  40 rounds of 5 steps train the fit to its best (the squared bias of eq. (3)
  is minimal, ~0.012, near 30-40 rounds), and the paper's "bias ~ 0.11" is then
  the root-mean-square bias; a squared bias of 0.11 needs early stopping
  (``rounds=5, local_steps=4, init_std=0.166``), which makes the bias grow at
  K = 40 (docs/fed_ensemble.md, "Toy regression").
  """
  config = ml_collections.ConfigDict()
  config.method = "fed_ensemble_toy"
  config.seed = 0
  config.num_clients = 50
  config.points_per_client = 2
  config.num_features = 100
  config.bandwidth = 0.08
  config.noise_sd = 0.2
  config.amplitude_sd = 0.2
  config.repetitions = 100
  config.modes = (1, 2, 10, 20, 40)
  config.rounds = 40
  config.local_steps = 5
  config.lr = 0.1
  config.init_std = 0.55  # calibrated so that K = 1 (FedAvg) has the paper's variance 0.05
  config.grid = 401
  if arg:
    raise ValueError(
      f"configs/fed_ensemble_toy.py has no variants; override fields with --config.<key>, got {arg!r}"
    )
  return config
