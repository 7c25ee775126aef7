"""FedAvg (McMahan et al. 2017) -- the NTK-FL comparison setting and its variants.

Default (``--config=configs/fedavg.py``): the server-based setting of
:func:`ntk_fl.configs._presets.server_config` (NTK-FL's comparison: FMNIST, 300
clients, α = 0.1, 20 clients per round, 20 full-batch epochs, lr 0.1, 300 rounds).
Uplink bits are counted per round and cumulatively.

FedAvg' (NTK-FL Fig. 3): ``algorithm.subsample_fraction`` (β, each participant's share of its
samples per round) and ``algorithm.projection_dim`` (d1' of CP-NTK-FL's shared seeded input
projection ``Z = X P``; ``projection_scale`` as CP-NTK-FL's) -- 1 and 0 (plain FedAvg) by default.

Variants: paper | iid | alpha<float> | mnist, and
:data:`ntk_fl.configs._presets.SERVER_VARIANTS` (full | busiest_node | q8, q4 | adam | smoke), and
  fig3         FedAvg' of NTK-FL Fig. 3: β = 0.4, d1' = 100 (cp_ntk_fl's ``fig3``).
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants

VARIANTS = {
  **presets.SERVER_VARIANTS,
  "fig3": presets.SERVER_NTK_VARIANTS["fig3"],
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.server_config(
    "fedavg",
    lr=0.1,
    epochs=20,
    batch_size=200,
    subsample_fraction=1.0,
    projection_dim=0,
    projection_scale="sqrt_input",
  )
  return apply_variants(config, arg, VARIANTS)
