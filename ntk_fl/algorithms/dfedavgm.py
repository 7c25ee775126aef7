"""DFedAvgM (Sun et al. 2021): DFedAvg with heavy-ball momentum (PyTorch semantics) in local steps.

The round is :func:`ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`'s.
"""

from __future__ import annotations

from ntk_fl.algorithms import gossip_round

__all__ = ["make_dfedavgm", "METHOD"]

METHOD = gossip_round.local_sgd_method("dfedavgm", "DFedAvgM")
make_dfedavgm = METHOD.make
