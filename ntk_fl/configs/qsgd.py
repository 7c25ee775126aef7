"""QSGD (Alistarh et al. 2017) -- NTK-FL Table 1's "QSGD (4 bit)" row: quantised stochastic gradients.

Default (``--config=configs/qsgd.py``): NTK-FL's comparison setting (FMNIST, 300 clients, α = 0.1,
MLP 784-100-10, 20 clients per round); each participant uploads the gradient of its loss at the
global model on its whole data (batch 200, NTK-FL's client batch size), QSGD-quantised at 4 bits per
coordinate (Table 1's 465 MB over 614 rounds of 20 clients is 4 bits per parameter: a sign and 3
level bits, s = 7), L2 norm per bucket of 512 entries (QSGD's 4-bit setting, Alistarh et al. 2017
§5), unbiased stochastic rounding; the server steps with the data-size-weighted mean at lr 0.1 (NTK-FL
gives no hyperparameter; 0.1 is the top of its learning-rate grid, not tuned here). 1,000 rounds
(Table 1: 614 to 85 %).

Variants: paper | iid | alpha<float> | mnist, and full | busiest_node | q8, q4 | smoke.
"""

import ml_collections

from ntk_fl import config as config_lib
from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def _smoke(config):
  config_lib.smoke_slice(config)
  config.algorithm.clients_per_round = 5


VARIANTS = {
  **presets.quantize_variants(),
  **presets.PARTICIPATION_VARIANTS,
  "smoke": _smoke,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = config_lib.base_config()
  config.method = "qsgd"
  config.rounds = 1000
  config.eval.clients_every = 0
  config.chunk_size = 0
  config.algorithm = ml_collections.ConfigDict(
    dict(
      clients_per_round=20,
      lr=0.1,
      lr_gamma=1.0,
      batch_size=200,
      quantize_bits=4,
      stochastic_rounding=True,
      bucket_size=512,
      qsgd_norm="l2",
    )
  )
  return apply_variants(config, arg, VARIANTS)
