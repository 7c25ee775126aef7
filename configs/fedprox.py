"""FedProx (Li et al. 2020) -- the NTK-FL comparison setting and its variants.

Default (``--config=configs/fedprox.py``): Fashion-MNIST, 300 clients, the
authors' fixed-size Dirichlet partition (≈200 samples each, α = 0.1), MLP
784-100-10; each round 20 of the 300 clients (uniformly, without replacement;
NTK-FL's setting) train from the global model and the server averages their
weights by data size. Local training: 20 epochs of full-batch gradient descent
(batch 200 = the client's data; NTK-FL's "client batch size 200"), lr 0.1,
plain SGD -- the values of the NTK-DFL authors' FedAvg notebook; NTK-FL tuned
the local iteration count over {1, 3, …, 50} and the lr over {1e-3, …, 1e-1}
without reporting the winner. 300 rounds (NTK-FL Table 1: FedAvg needs 284 to
reach 85% at α = 0.1). Local objective adds (μ/2)·||w − w_global||² with μ = 0.01
(no paper here states μ; 0.01 is from FedProx's own grid {0.001, 0.01, 0.1, 1}).
Uplink bits are counted per round and cumulatively.

Variants (comma-separated): paper | iid | alpha<float> | mnist |
full (all 300 clients every round; the authors' notebook, part_rate 1) |
busiest_node (5 clients per round: NTK-DFL App. C.1's matching of the server's
degree to κ = 5) | q8, q4 (quantised uploads; NTK-FL Table 1 compares QSGD at 4
bits) | smoke.
"""
import ml_collections

from ntk_fl.algorithms import local
from ntk_fl.config import apply_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = local.server_config("fedprox", lr=0.1, epochs=20, batch_size=200, prox_mu=0.01)
  return apply_variants(config, arg, local.SERVER_VARIANTS)
