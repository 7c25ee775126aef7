"""DFedAvg (Sun et al. 2021): several local epochs of plain SGD, then one gossip step.

The round is :func:`ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`'s.
"""

from __future__ import annotations

from ntk_fl.algorithms import gossip_round

__all__ = ["check", "make_dfedavg", "METHOD"]

METHOD = gossip_round.local_sgd_method("dfedavg", "DFedAvg", plain_sgd=True)
make_dfedavg = METHOD.make
check = METHOD.check
