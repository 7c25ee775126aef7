"""DFedAvg (Sun et al. 2021) -- the NTK-DFL comparison setting and its variants.

Default (``--config=configs/dfedavg.py``): Fashion-MNIST, 300 clients, the
authors' fixed-size Dirichlet partition (≈200 samples each, α = 0.1), MLP
784-100-10 with a shared initialisation, a new random 5-regular graph every
round, uniform 1/(deg+1) gossip weights. Each round every client runs 20 local
epochs (passes over its ≈200 samples) of plain SGD, lr 0.1 (constant), batch
25, then one gossip step (NTK-DFL App. C.2 and the authors' code: "the DFedAvgM
script with momentum 0"). 200 rounds (the paper's rounds-to-85% table goes to
200); aggregated model scored every round, every client every 5 rounds (the
authors logged every 5).

Variants (comma-separated): paper | iid | alpha<float> | static | mnist |
authors_alpha<float>[_d<k>] | authors_iid[_d<k>] (the authors' partition files) |
q8, q4 (quantised weights; the authors' quantised baselines use 256 levels = 8
bits) | smoke (seconds-long run on a slice of Fashion-MNIST).
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.gossip_config("dfedavg", lr=0.1, epochs=20, batch_size=25)
  return apply_variants(config, arg, presets.GOSSIP_VARIANTS)
