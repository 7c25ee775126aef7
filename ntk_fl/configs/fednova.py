"""FedNova (Wang et al. 2020) -- the NTK-FL comparison setting and its variants.

Default (``--config=configs/fednova.py``): the server-based setting of
:func:`ntk_fl.configs._presets.server_config` (NTK-FL's comparison: FMNIST, 300
clients, α = 0.1, 20 clients per round, 20 full-batch epochs, lr 0.1, 300 rounds).
Aggregation is FedNova's normalised averaging (each update
divided by the client's local step count, rescaled by the weighted mean count);
NTK-FL gives no further details ("clients transmit normalized gradient
vectors"). Uplink bits are counted per round and cumulatively.

Variants: paper | iid | alpha<float> | mnist, and
:data:`ntk_fl.configs._presets.SERVER_VARIANTS` (full | busiest_node | q8, q4 | smoke).
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.server_config("fednova", lr=0.1, epochs=20, batch_size=200)
  return apply_variants(config, arg, presets.SERVER_VARIANTS)
