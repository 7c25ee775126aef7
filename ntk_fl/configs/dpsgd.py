"""D-PSGD (Lian et al. 2017) as the NTK-DFL authors ran it -- setting and variants.

Default (``--config=configs/dpsgd.py``): the shared decentralised setting of
``configs/dfedavg.py`` (Fashion-MNIST, 300 clients, α = 0.1, MLP 784-100-10,
new random 5-regular graph per round, uniform gossip, 200 rounds). Local
training: one epoch over the client's ≈200 samples (≈20 SGD steps of batch
10), lr 0.1, no momentum, then one gossip step (NTK-DFL App. C.2; the
authors implemented it with their DFedAvgM script). The paper's Fig. 2 table
uses κ = 5; the authors' stored config has degree 9 (variant ``degree9``).

Variants: paper | iid | alpha<float> | static | mnist | degree9 | q8, q4 |
smoke.
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants

VARIANTS = {**presets.GOSSIP_VARIANTS, "degree9": lambda c: setattr(c.topology, "degree", 9)}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.gossip_config("dpsgd", lr=0.1, epochs=1, batch_size=10)
  return apply_variants(config, arg, VARIANTS)
