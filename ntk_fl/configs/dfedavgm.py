"""DFedAvgM (Sun et al. 2021) -- the NTK-DFL comparison setting and its variants.

Default (``--config=configs/dfedavgm.py``): the shared decentralised setting of
``configs/dfedavg.py`` (Fashion-MNIST, 300 clients, α = 0.1, MLP 784-100-10,
new random 5-regular graph per round, uniform gossip, 200 rounds). Local
training: 20 epochs of SGD with heavy-ball momentum 0.9 (PyTorch semantics:
no dampening, no Nesterov, no weight decay), lr 0.01, batch 50 (NTK-DFL App.
C.2 = the authors' config). The optimiser's velocity starts at zero every
round (the authors build the optimiser inside each round's local training).

Variants: paper | iid | alpha<float> | static | mnist | q8, q4 |
quantized (the authors' DFedAvgM-Q script: 8 bits, 5 epochs, momentum 0,
1000 rounds) | smoke.
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def _quantized(config):
  """The authors' quantised DFedAvgM script: 8 bits, 5 epochs, no momentum, 1000 rounds."""
  config.algorithm.quantize_bits = 8
  config.algorithm.epochs = 5
  config.algorithm.momentum = 0.0
  config.rounds = 1000


VARIANTS = {**presets.GOSSIP_VARIANTS, "quantized": _quantized}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.gossip_config("dfedavgm", lr=0.01, epochs=20, batch_size=50, momentum=0.9)
  return apply_variants(config, arg, VARIANTS)
