"""Names that several layers share, as plain constants: a leaf, so naming them loads no code behind them.

* the config's string choices (datasets, partitions, models, activations): the schema checks a config
  against them without importing the data loaders, the partitioners or flax; the modules that
  implement them re-export them (``ntk_fl.data.sources.DATASETS``, ``ntk_fl.data.partition.PARTITIONS``,
  ``ntk_fl.models.MODELS`` and ``ACTIVATIONS``);
* the names of the shipped Fashion-MNIST partitions of the NTK-FL / NTK-DFL authors
  (:data:`VENDORED_MAPS`, :func:`authors_map_name`; public in ``ntk_fl.data.index_map``, which reads
  them), so that a config variant naming one loads no data code;
* the device mesh's client axis (:data:`CLIENTS`, public as ``ntk_fl.parallel.CLIENTS``), which the
  multi-process code names without importing the client map.
"""

from __future__ import annotations

__all__ = [
  "DATASETS",
  "PARTITIONS",
  "MODELS",
  "ACTIVATIONS",
  "AUTHORS_ALPHAS",
  "AUTHORS_DIRICHLET_DRAWS",
  "AUTHORS_IID_DRAWS",
  "VENDORED_DATASET",
  "VENDORED_MAPS",
  "authors_map_name",
  "CLIENTS",
]

DATASETS = (
  "fashion_mnist",
  "mnist",
  "emnist_digits",
  "femnist",
  "femnist_digits",
  "cifar10",
  "synthetic",
)
"""``config.data.name``: the datasets :func:`ntk_fl.data.sources.load` reads."""

PARTITIONS = (
  "iid",
  "dirichlet",
  "dirichlet_fixed_size",
  "shards",
  "by_writer",
  "contiguous",
  "index_map",
)
"""``config.data.partition``: the partitions :func:`ntk_fl.data.partition.partition` builds."""

MODELS = ("mlp", "cnn")
"""``config.model.name``: the models :func:`ntk_fl.models.make_model` builds."""

ACTIVATIONS = (
  "relu",
  "tanh",
  "gelu",
  "sigmoid",
  "softplus",
  "elu",
  "silu",
  "erf",
  "identity",
)
"""``config.model.activation``, in the order of ``ntk_fl.models``' table of activation functions."""

AUTHORS_ALPHAS = ("0.1", "0.2", "0.3", "0.4", "0.5")
AUTHORS_DIRICHLET_DRAWS = 5
AUTHORS_IID_DRAWS = 3

VENDORED_MAPS = tuple(
  [f"fmnist_alpha{a}_{d}" for a in AUTHORS_ALPHAS for d in range(AUTHORS_DIRICHLET_DRAWS)]
  + [f"fmnist_iid_{d}" for d in range(AUTHORS_IID_DRAWS)]
)
"""Names of the shipped maps (``<name>.npz`` in ``ntk_fl.data.index_map.VENDORED_DIR``); all are
Fashion-MNIST, 300 clients."""

VENDORED_DATASET = "fashion_mnist"


def authors_map_name(level: str, draw: int = 0) -> str:
  """Name of a shipped map: ``level`` is an α such as ``'0.1'`` / ``0.1``, or ``'iid'``.

  Raises ``ValueError`` naming the levels and draws that exist.
  """
  if level != "iid":
    try:
      level = f"alpha{float(level):g}"
    except (TypeError, ValueError):
      level = f"alpha{level}"
  name = f"fmnist_{level}_{draw}"
  if name not in VENDORED_MAPS:
    raise ValueError(
      f"no shipped partition {name!r}: the authors' Fashion-MNIST maps exist for alpha in "
      f"{{{', '.join(AUTHORS_ALPHAS)}}} with draws 0-{AUTHORS_DIRICHLET_DRAWS - 1} and for iid with "
      f"draws 0-{AUTHORS_IID_DRAWS - 1}"
    )
  return name


CLIENTS = "clients"
"""Name of the mesh axis the client axis is sharded over."""
