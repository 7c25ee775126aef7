"""D-PSGD (Lian et al. 2017) as the NTK-DFL authors coded it: an epoch of plain SGD, then gossip.

About 20 steps of batch 10 per round before the gossip step; the round is
:func:`ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`'s.
"""

from __future__ import annotations

from ntk_fl.algorithms import gossip_round

__all__ = ["check", "make_dpsgd", "METHOD"]

METHOD = gossip_round.local_sgd_method("dpsgd", "D-PSGD", plain_sgd=True)
make_dpsgd = METHOD.make
check = METHOD.check
