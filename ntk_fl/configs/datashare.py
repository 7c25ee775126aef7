"""DataShare (Zhao et al. 2018) -- the NTK-FL comparison setting and its variants.

Default (``--config=configs/datashare.py``): the server-based setting of
:func:`ntk_fl.configs._presets.server_config` (NTK-FL's comparison: FMNIST, 300
clients, α = 0.1, 20 clients per round, 20 full-batch epochs, lr 0.1, 300 rounds).
A global set of 10% of the total number of local data
points (NTK-FL; ≈6,000 samples, drawn once without replacement from the clients'
samples) is broadcast and mixed into every participant's local minibatches
(batch 200 over its ≈6,200 samples); aggregation by own data size. Uplink bits
are counted per round and cumulatively (the one-off broadcast of the set is not).

Variants: paper | iid | alpha<float> | mnist, and
:data:`ntk_fl.configs._presets.SERVER_VARIANTS` (full | busiest_node | q8, q4 | smoke).
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.server_config("datashare", lr=0.1, epochs=20, batch_size=200, share_fraction=0.1)
  return apply_variants(config, arg, presets.SERVER_VARIANTS)
