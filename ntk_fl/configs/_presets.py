"""Paper presets shared by several config files: the method families' settings and their variants.

The config files of this directory build on these: the gradient baselines on
:func:`server_config` (FedAvg family, NTK-FL's comparison setting) or
:func:`gossip_config` (decentralized baselines), NTK-FL and CP-NTK-FL on
:func:`server_ntk_config`. The values are the papers' (or the authors' code's)
and each docstring says where they come from; the library below the config
schema holds no paper values.
"""

from __future__ import annotations

import ml_collections

from ntk_fl import config as config_lib

__all__ = [
  "local_config",
  "adam_variant",
  "quantize_variants",
  "server_config",
  "gossip_config",
  "PARTICIPATION_VARIANTS",
  "SERVER_VARIANTS",
  "GOSSIP_VARIANTS",
  "PAPER_TAUS",
  "CODE_TAUS",
  "server_ntk_config",
  "SERVER_NTK_VARIANTS",
]


def local_config(
  *,
  lr: float,
  epochs: int,
  batch_size: int,
  lr_gamma: float = 1.0,
  momentum: float = 0.0,
  nesterov: bool = False,
  weight_decay: float = 0.0,
  quantize_bits: int = 32,
  stochastic_rounding: bool = False,
  optimizer: str = "sgd",
  adam_b1: float = 0.9,
  adam_b2: float = 0.999,
  adam_eps: float = 1e-8,
  **extra,
):
  """A ``config.algorithm`` block with every field of :class:`ntk_fl.algorithms.local.LocalHParams` (+ ``extra``).

  The client optimiser is SGD unless ``optimizer='adam'`` (variant ``adam``: Fed-ensemble's Shakespeare
  clients; PyTorch's defaults β = (0.9, 0.999), ε = 1e-8).
  """
  return ml_collections.ConfigDict(
    dict(
      lr=lr,
      lr_gamma=lr_gamma,
      epochs=epochs,
      batch_size=batch_size,
      momentum=momentum,
      nesterov=nesterov,
      weight_decay=weight_decay,
      quantize_bits=quantize_bits,
      stochastic_rounding=stochastic_rounding,
      optimizer=optimizer,
      adam_b1=adam_b1,
      adam_b2=adam_b2,
      adam_eps=adam_eps,
      **extra,
    )
  )


def adam_variant(config):
  """Variant `adam`: the clients train with Adam (no SGD momentum)."""
  config.algorithm.optimizer = "adam"
  config.algorithm.momentum, config.algorithm.nesterov = 0.0, False


def quantize_variants(bits=(8, 4)) -> dict:
  """Config variants ``q<b>``: send ``b``-bit quantised weights (nearest level)."""
  return {
    f"q{b}": (lambda config, b=b: setattr(config.algorithm, "quantize_bits", b)) for b in bits
  }


# ----------------------------------------------------------------------------- config families


def server_config(method: str, *, rounds: int = 300, clients_per_round: int = 20, **algorithm):
  """Base config of a server-based baseline (FedAvg family): NTK-FL's comparison setting.

  Fashion-MNIST, 300 clients, the authors' fixed-size Dirichlet partition (≈200
  samples each, α = 0.1), MLP 784-100-10; each round ``clients_per_round`` = 20
  of the 300 clients (uniformly, without replacement; NTK-FL's setting) train
  from the global model and the server averages their weights by data size.
  The configs use 20 epochs of full-batch gradient descent (batch 200 = the
  client's data; NTK-FL's "client batch size 200"), lr 0.1, plain SGD -- the
  NTK-DFL authors' FedAvg notebook; NTK-FL tuned the local iteration count over
  {1, 3, …, 50} and the lr over {1e-3, …, 1e-1} without reporting the winner --
  and 300 rounds (NTK-FL Table 1: FedAvg needs 284 to reach 85 % at α = 0.1).
  Uplink bits are counted per round and cumulatively.

  One global model (so ``client_params`` has one row and the aggregated
  evaluation is the evaluation; per-client evaluation is off), ``clients_per_round``
  of the clients train each round, ``algorithm`` goes to :func:`local_config`.
  """
  config = config_lib.base_config()
  config.method = method
  config.rounds = rounds
  config.eval.clients_every = 0
  config.chunk_size = 0
  config.algorithm = local_config(clients_per_round=clients_per_round, **algorithm)
  return config


def gossip_config(method: str, *, rounds: int = 200, **algorithm):
  """Base config of a decentralized baseline: train locally, then one uniform gossip step.

  The authors' baselines average uniformly with their neighbours (1/(κ+1)); the
  per-client evaluation runs every 5 rounds (it is the expensive part of a
  300-client evaluation); 30 clients per vmap chunk (measured fastest for local
  training on 2 cores).
  """
  config = config_lib.base_config()
  config.method = method
  config.rounds = rounds
  config.topology.mixing = "uniform"
  config.eval.clients_every = 5
  config.chunk_size = 30
  config.algorithm = local_config(**algorithm)
  return config


def _server_smoke(config):
  config_lib.smoke_slice(config)
  config.algorithm.clients_per_round = 5
  config.algorithm.epochs = min(config.algorithm.epochs, 2)


def _gossip_smoke(config):
  config_lib.smoke_slice(config)
  config.eval.clients_every = 1
  config.algorithm.epochs = min(config.algorithm.epochs, 2)


PARTICIPATION_VARIANTS = {
  "full": lambda c: setattr(c.algorithm, "clients_per_round", 0),  # every client, every round
  "busiest_node": lambda c: setattr(
    c.algorithm, "clients_per_round", 5
  ),  # NTK-DFL App. C.1 (κ = 5)
}
SERVER_VARIANTS = {
  **quantize_variants(),
  **PARTICIPATION_VARIANTS,
  "adam": adam_variant,
  "smoke": _server_smoke,
}
"""Variants of the server-based configs: ``q8``/``q4``, ``full``, ``busiest_node``, ``adam``, ``smoke``."""
GOSSIP_VARIANTS = {**quantize_variants(), "adam": adam_variant, "smoke": _gossip_smoke}
"""Variants of the decentralized configs: ``q8``/``q4``, ``smoke``."""


# ----------------------------------------------------------------------------- NTK-FL / CP-NTK-FL

PAPER_TAUS = tuple(range(100, 2001, 100))
"""NTK-FL's grid (paper Sec. 6: 100, 200, ..., 2000); the authors' code uses :data:`CODE_TAUS`."""
CODE_TAUS = (100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1500, 2000)


def server_ntk_config(**algorithm):
  """The NTK-FL paper setting (``configs/ntk_fl.py``); ``algorithm`` overrides ``config.algorithm`` keys.

  Fashion-MNIST, 300 clients, the authors' fixed-size Dirichlet partition (≈200
  samples each, α = 0.1), MLP 784-100-10; 20 clients per round; η = 0.01
  constant; τ ∈ {100, ..., 2000}; cross-entropy evolution by exact Euler GD;
  τ chosen by the non-linear network's pooled training loss; no compression;
  50 rounds (the authors' code). One global model, so per-client evaluation is off.
  """
  config = config_lib.base_config()
  config.method = "ntk_fl"
  config.rounds = 50
  config.eval.clients_every = 0
  config.chunk_size = 0
  config.algorithm = ml_collections.ConfigDict(
    dict(
      clients_per_round=20,
      lr=0.01,
      lr_decay=0.0,
      taus=PAPER_TAUS,
      loss="ce",
      solver="euler",
      select="network",
      kernel="traced",
      jacobian="auto",
      jacobian_chunk=0,
      subsample_fraction=1.0,
      projection_dim=0,
      projection_scale="sqrt_input",
      sparsify_keep=1.0,
      quantize_bits=32,
      stochastic_rounding=False,
      shuffle=False,
      validation_clients=0,
    )
  )
  for name, value in algorithm.items():
    if name not in config.algorithm:
      raise ValueError(
        f"unknown config.algorithm key {name!r}; the keys are {list(config.algorithm.keys())}"
      )
    config.algorithm[name] = value
  return config


def _server_ntk_smoke(config):
  config_lib.smoke_slice(config, rounds=3)
  config.algorithm.clients_per_round = 5
  config.algorithm.taus = (50, 100, 200)
  config.checkpoint_every = 2


def _busiest_node(config):
  # NTK-DFL App. C.1: the server is no busier than the busiest node of a 5-regular graph -> 5 clients per round.
  config.algorithm.clients_per_round = 5
  config.rounds = 250


def _table1_compression(config):
  # Top-2 % of every Jacobian row (index list, 15-bit indices for d' = 21,110) at 8 bits per value:
  # 0.02 * (8 + 15) = 0.46 bits per raw entry, ≈ 0.69 MiB per client per round at N'_m = 59 -- the
  # ≈ 0.5 bits/entry (0.742 MiB) that Table 1's 386 MB over 26 rounds implies (docs/ntk_fl.md).
  config.algorithm.sparsify_keep = 0.02
  config.algorithm.quantize_bits = 8


def _set(**values):
  def apply(config):
    for name, value in values.items():
      config.algorithm[name] = value

  return apply


SERVER_NTK_VARIANTS = {
  "smoke": _server_ntk_smoke,
  "mse": _set(loss="mse"),
  "ode": _set(solver="ode"),
  "code_taus": _set(taus=CODE_TAUS),
  "code_clients": _set(clients_per_round=21),
  "busiest_node": _busiest_node,
  "shuffle": _set(shuffle=True),
  "explicit": _set(jacobian="explicit"),
  "linearized": _set(select="linearized"),
  "table1": _table1_compression,
  "stochastic": _set(stochastic_rounding=True),
  "fig3": _set(projection_dim=100, subsample_fraction=0.4),
  # NTK-FL §3 after eq. 11: τ by a validation set from held-out clients. The paper gives no size: 10 of the
  # 300 clients (≈ 2,000 samples, 1/30 of the training data) hold it.
  "validation": _set(select="validation", validation_clients=10),
}
"""Variants of ``configs/ntk_fl.py`` and ``configs/cp_ntk_fl.py`` (besides the common ``iid``/``alpha<a>``/
``mnist``): ``smoke``, ``mse``, ``ode``, ``code_taus``, ``code_clients`` (21 per round, the authors'
``part_rate``), ``busiest_node`` (5 per round, NTK-DFL App. C.1), ``shuffle``, ``explicit``,
``linearized``, ``table1`` (sparsification + 8-bit quantisation matching Table 1's uplink),
``stochastic`` (stochastic rounding), ``fig3`` (d1' = 100, β = 0.4), ``validation`` (τ scored on 10
held-out validation clients)."""
