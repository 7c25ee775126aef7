"""CP-NTK-FL (Yue et al., ICML 2022, Sec. 4.2): NTK-FL with the client-side compression stack.

Default (``--config=configs/cp_ntk_fl.py``): the Table 1 setting -- NTK-FL's
paper setting (Fashion-MNIST, 300 clients, α = 0.1, 20 per round, MLP with 100
hidden units) with every client keeping a random β = 0.3 of its samples each
round and projecting its inputs with the shared seeded Gaussian P (d1 = 784 ->
d1' = 200; the model's input layer is 200), no Jacobian sparsification or
quantisation (the paper states none for Table 1); 50 rounds.

Variants (comma-separated, e.g. ``:table1,shuffle``):
  paper | iid | alpha<float> | mnist   (common)
  authors_alpha<float>[_d<k>] | authors_iid[_d<k>] | contiguous   as configs/ntk_fl.py.
  table1       + top-2 % per Jacobian row, 8-bit values: ≈ 0.46 bits per raw Jacobian entry with
               index overhead, the ≈ 0.5 implied by Table 1's 386 MB (docs/ntk_fl.md).
  stochastic   stochastic (unbiased) rounding in the quantiser.
  fig3         d1' = 100, β = 0.4 (the paper's Fig. 3).
  shuffle      shuffling server.
  smoke, mse, ode, code_taus, code_clients, busiest_node, explicit, linearized: as configs/ntk_fl.py.
  cnn          the papers' CNN. The secret projection maps flattened inputs into an MLP's first dense
               layer, so it is off (d1' = 0); β-subsampling and the Jacobian compression stay.
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import COMMON_VARIANTS, apply_variants


def _cnn(config):
  COMMON_VARIANTS["cnn"](config)
  config.algorithm.projection_dim = 0


VARIANTS = {**presets.SERVER_NTK_VARIANTS, "cnn": _cnn}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = presets.server_ntk_config(projection_dim=200, subsample_fraction=0.3)
  return apply_variants(config, arg, VARIANTS)
