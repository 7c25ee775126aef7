"""A tiny config for runner tests: ``toy_gd`` on the synthetic dataset.

10 clients, IID split of the 1,000 synthetic samples, MLP 784-16-10, a static
ring. ``method_module`` points at ``tests/toy_method.py`` by absolute path, so
``python experiments/main.py --config=tests/configs/toy.py:smoke`` works from
any working directory.

Variants: ``smoke`` (4 rounds, checkpoint every 2) plus the common ones.
"""

import os

import ml_collections

from ntk_fl.config import apply_variants, base_config


def _smoke(config):
  config.rounds = 4
  config.checkpoint_every = 2


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = base_config()
  config.method = "toy_gd"
  config.method_module = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, "toy_method.py"
  )
  config.rounds = 6
  config.data.name = "synthetic"
  config.data.partition = "iid"
  config.data.num_clients = 10
  config.data.samples_per_client = 0
  config.model.hidden = (16,)
  config.topology.name = "ring"
  config.topology.dynamic = False
  config.eval.batch_size = 128
  config.eval.targets = (0.2, 0.99)  # one reached within the smoke run, one never
  config.checkpoint_every = 2
  config.chunk_size = 4
  config.algorithm = ml_collections.ConfigDict()
  config.algorithm.lr = 0.5
  return apply_variants(config, arg, {"smoke": _smoke})
