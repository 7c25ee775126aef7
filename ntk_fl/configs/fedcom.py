"""FedCOM (Haddadpour et al. 2021) -- NTK-FL Table 1's FedCOM row: local SGD with a quantised uplink.

Default (``--config=configs/fedcom.py``): the server-based setting of
:func:`ntk_fl.configs._presets.server_config` (NTK-FL's comparison: FMNIST, 300 clients, α = 0.1,
20 clients per round, FedAvg's 20 full-batch epochs at lr 0.1), each participant uploading its local
update ``w - w_k`` QSGD-quantised at 8 bits per coordinate (Table 1's 379 MB over 250 rounds of 20
clients is 8 bits per parameter), L2 norm per bucket of 8,192 entries (QSGD's 8-bit setting, Alistarh
et al. 2017 §5), unbiased stochastic rounding, server step γ = 1 (Haddadpour et al.'s Algorithm 1;
NTK-FL gives no hyperparameter). 400 rounds (Table 1: 250 to 85 %). Uplink bits are counted per round
and cumulatively (:func:`ntk_fl.communication.qsgd_upload_bits`, norms included).

Variants: paper | iid | alpha<float> | mnist, and
:data:`ntk_fl.configs._presets.SERVER_VARIANTS` (full | busiest_node | q8, q4 | adam | smoke).
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.server_config(
    "fedcom",
    rounds=400,
    lr=0.1,
    epochs=20,
    batch_size=200,
    quantize_bits=8,
    stochastic_rounding=True,
    server_lr=1.0,
    bucket_size=8192,
    qsgd_norm="l2",
  )
  return apply_variants(config, arg, presets.SERVER_VARIANTS)
