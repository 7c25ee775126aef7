"""DFedSAM (Shi et al. 2023) -- the NTK-DFL comparison setting and its variants.

Default (``--config=configs/dfedsam.py``): the shared decentralised setting of
``configs/dfedavg.py`` (Fashion-MNIST, 300 clients, α = 0.1, MLP 784-100-10,
new random 5-regular graph per round, uniform gossip, 200 rounds as in the
authors' DFedSAM config). Local training (NTK-DFL App. C.2 and the authors'
config): 5 epochs, batch 32, adaptive SAM (ASAM, ``T = |w|``) with radius
ρ = 0.01, SGD momentum 0.99, weight decay 5e-4, lr 0.01 decayed ×0.95 per round
(``lr_r = 0.01 · 0.95^r``). Optimiser state restarts every round.

Variants: paper | iid | alpha<float> | static | mnist | sam (non-adaptive SAM)
| q8, q4 | smoke.
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants

VARIANTS = {**presets.GOSSIP_VARIANTS, "sam": lambda c: setattr(c.algorithm, "sam_adaptive", False)}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.gossip_config(
    "dfedsam",
    lr=0.01,
    lr_gamma=0.95,
    epochs=5,
    batch_size=32,
    momentum=0.99,
    weight_decay=5e-4,
    sam_rho=0.01,
    sam_adaptive=True,
  )
  return apply_variants(config, arg, VARIANTS)
