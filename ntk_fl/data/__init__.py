"""Datasets, partitions and the stacked client arrays every algorithm consumes.

* :func:`load` reads a dataset from its standard on-disk format (never a silent
  substitute) and normalises it.
* :func:`partition` splits training indices over clients (IID, Dirichlet,
  the NTK papers' fixed-size Dirichlet generator, shards, by writer).
* :func:`make_federation` gives every client a padded index list into one copy
  of the samples: a :class:`Federation`, gathered per chunk of clients.
"""

from ntk_fl.data.sources import Dataset, load, DATASETS
from ntk_fl.data.partition import partition, PARTITIONS
from ntk_fl.data.federation import Federation, federation_from_padded, make_federation
from ntk_fl.data.plots import plot_label_distribution

__all__ = [
  "Dataset",
  "load",
  "DATASETS",
  "partition",
  "PARTITIONS",
  "Federation",
  "make_federation",
  "federation_from_padded",
  "plot_label_distribution",
]
