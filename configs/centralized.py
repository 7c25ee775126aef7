"""Centralised training reference (NTK-FL's "centralized training simulation").

Default (``--config=configs/centralized.py``): Fashion-MNIST, 300 clients, the
authors' fixed-size Dirichlet partition (≈200 samples each, α = 0.1), MLP
784-100-10. Each round 20 of the 300 clients are drawn (as FedAvg's
participants, uniformly without replacement), the server collects their
samples and trains the global model on the union with FedAvg's optimiser
settings: 20 epochs, batch 200, lr 0.1, plain SGD (NTK-FL states neither the
step count nor the lr; matching FedAvg's per-sample work makes this the upper
bound it is meant to be). 300 rounds, like ``configs/fedavg.py``. The bits
counted are the raw samples uploaded (float32 features + label); there are no
quantisation variants (no weights are sent).

Variants (comma-separated): paper | iid | alpha<float> | mnist |
full (all 300 clients every round) | busiest_node (5 clients per round) | smoke.
"""
import ml_collections

from ntk_fl.algorithms import local
from ntk_fl.config import apply_variants, base_config


def _smoke(config):
  config.rounds = 2
  config.data.max_train = 6_000
  config.data.num_clients = 20
  config.data.samples_per_client = 100
  config.algorithm.clients_per_round = 5
  config.algorithm.epochs = 2
  config.eval.batch_size = 2_000
  config.checkpoint_every = 1


VARIANTS = {  # no q<b> variants: raw data are sent, not weights
    "full": lambda c: setattr(c.algorithm, "clients_per_round", 0),
    "busiest_node": lambda c: setattr(c.algorithm, "clients_per_round", 5),
    "smoke": _smoke,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = base_config()
  config.method = "centralized"
  config.rounds = 300
  config.eval.clients_every = 0   # one global model: the aggregated evaluation is the evaluation
  config.chunk_size = 0
  config.algorithm = local.local_config(lr=0.1, epochs=20, batch_size=200, clients_per_round=20)
  return apply_variants(config, arg, VARIANTS)
