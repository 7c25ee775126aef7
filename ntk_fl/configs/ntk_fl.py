"""NTK-FL (Yue et al., ICML 2022) -- the paper setting and its variants.

Default (``--config=configs/ntk_fl.py``): Fashion-MNIST, 300 clients with the
authors' fixed-size Dirichlet partition (≈200 samples each, α = 0.1), MLP
784-100-10; each round 20 of the 300 clients send Jacobians, labels and logits
at the global weights; the server evolves the pooled kernel (cross-entropy,
exact Euler GD, η = 0.01), keeps the τ ∈ {100, ..., 2000} with the lowest
pooled training loss of the non-linear network; 50 rounds; no compression
(the server never materialises J: structured kernel + one VJP).

Variants (comma-separated, e.g. ``:busiest_node,iid``):
  paper | iid | alpha<float> | mnist | cnn   (common; cnn: the papers' CNN instead of the MLP)
  authors_alpha<float>[_d<k>] | authors_iid[_d<k>]   the authors' partition files (draw 0 unless _d<k>).
  contiguous    client i holds samples [200 i, 200 i + 200): the split the authors' NTK-FL code falls
                back to, because its configured partition file does not exist.
  smoke         seconds on a 6,000-sample slice, 5 of 20 clients per round, τ ∈ {50, 100, 200}.
  mse           half-MSE evolution in closed form (the paper's eq. 9a/10).
  ode           the authors' numerics: adaptive Dopri5 (rtol 1e-7, atol 1e-9), left Riemann sum.
  code_taus     the authors' code grid {100, ..., 1000, 1500, 2000}.
  code_clients  21 clients per round (the code's part_rate 0.07).
  busiest_node  5 clients per round, 250 rounds: NTK-DFL App. C.1's node-busyness-matched NTK-FL.
  shuffle       shuffling server (synchronised permutation; the update is unchanged).
  explicit      materialise J on the server (same update, for checking; 12.7 GB at paper scale).
  linearized    choose τ by the loss of the evolved f_τ instead of the real network.
  CP-NTK-FL options (table1, stochastic, fig3) also apply; see configs/cp_ntk_fl.py.
"""

import ml_collections

from ntk_fl.configs import _presets as presets
from ntk_fl.config import apply_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return apply_variants(presets.server_ntk_config(), arg, presets.SERVER_NTK_VARIANTS)
