"""DisPFL (Dai et al. 2022) -- the NTK-DFL comparison setting and its variants.

Default (``--config=configs/dispfl.py``): the shared decentralised setting of
``configs/dfedavg.py`` (Fashion-MNIST, 300 clients, α = 0.1, MLP 784-100-10,
shared initialisation, new random 5-regular graph per round, 200 rounds).
Hyperparameters (NTK-DFL App. C.2 and the authors' sweep config): lr 0.1 decayed
×0.998 per round, batch 10, 10 local epochs, no momentum, weight decay 5e-4,
dense ratio 0.5 per weight matrix (biases dense), anneal factor 0.5 (cosine
annealed mask-update fraction over ``rounds``). Masked aggregation is uniform
over the neighbours holding each coordinate (``topology.mixing`` must be
``uniform``). Reported: the uniform mean of the personalised models (as
NTK-DFL). Simplifications (see ``ntk_fl/algorithms/dispfl.py``): equal
density per matrix instead of ERK; neighbours from the shared graph instead of
DisPFL's own random choice of 5 of 300.

Variants: paper | iid | alpha<float> | static | mnist | q8, q4 | smoke.
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.gossip_config(
    "dispfl",
    lr=0.1,
    lr_gamma=0.998,
    epochs=10,
    batch_size=10,
    weight_decay=5e-4,
    dense_ratio=0.5,
    anneal_factor=0.5,
  )
  return apply_variants(config, arg, presets.GOSSIP_VARIANTS)
