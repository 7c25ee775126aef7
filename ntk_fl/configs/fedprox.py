"""FedProx (Li et al. 2020) -- the NTK-FL comparison setting and its variants.

Default (``--config=configs/fedprox.py``): the server-based setting of
:func:`ntk_fl.configs._presets.server_config` (NTK-FL's comparison: FMNIST, 300
clients, α = 0.1, 20 clients per round, 20 full-batch epochs, lr 0.1, 300 rounds).
Local objective adds (μ/2)·||w − w_global||² with μ = 0.01
(no paper here states μ; 0.01 is from FedProx's own grid {0.001, 0.01, 0.1, 1}).
Uplink bits are counted per round and cumulatively.

Variants: paper | iid | alpha<float> | mnist, and
:data:`ntk_fl.configs._presets.SERVER_VARIANTS` (full | busiest_node | q8, q4 | smoke).
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.server_config("fedprox", lr=0.1, epochs=20, batch_size=200, prox_mu=0.01)
  return apply_variants(config, arg, presets.SERVER_VARIANTS)
