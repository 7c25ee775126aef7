"""FedAvg (McMahan et al. 2017): local SGD on the participants, then ``w <- sum_k p_k w_k``.

The round, the participants' draw and the bit count are :mod:`ntk_fl.algorithms.server_round`'s;
``p_k = n_k / sum_K n`` weighs each participant by its data size.
"""

from __future__ import annotations

from ntk_fl.algorithms import server_round

__all__ = ["make_fedavg", "METHOD"]


METHOD = server_round.server_method("fedavg", "FedAvg", server_round.federated_update)
make_fedavg = METHOD.make
