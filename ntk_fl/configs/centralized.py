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

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants

# No q<b> variants: the centralised reference sends raw data, not weights.
VARIANTS = {
  **presets.PARTICIPATION_VARIANTS,
  "adam": presets.adam_variant,
  "smoke": presets.SERVER_VARIANTS["smoke"],
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.server_config("centralized", lr=0.1, epochs=20, batch_size=200)
  return apply_variants(config, arg, VARIANTS)
