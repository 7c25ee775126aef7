"""The user's own flax module from the config (``config.model.module = 'package.module:factory'``).

* The schema imports it and probes it before any data loads; each way it can be wrong is one clear error.
* ``models.make_model`` builds it as it builds the library's models: the same ``apply`` as the module's,
  on unflattened images, ``per_sample`` as the config says; an NTK method runs a round with it.
* A run directory naming a module does not import it when read.
"""

from __future__ import annotations

import json
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
import pytest

from ntk_fl import config as config_lib
from ntk_fl import models, rundir, runner, schema
from ntk_fl._src import method_modules, user_model

_SOURCE = textwrap.dedent("""
    import flax.linen as nn
    import jax

    class Tiny(nn.Module):
      num_classes: int

      @nn.compact
      def __call__(self, x):
        x = jax.nn.relu(nn.Conv(2, (3, 3), name="conv")(x))
        x = nn.avg_pool(x, (4, 4), (4, 4)).reshape(x.shape[0], -1)
        return nn.Dense(self.num_classes, name="head")(x)

    SEEN = []

    def make(input_shape, num_classes):
      SEEN.append((input_shape, num_classes))
      return Tiny(num_classes)

    def not_a_module(input_shape, num_classes):
      return "conv"

    def wrong_head(input_shape, num_classes):
      return Tiny(num_classes + 1)

    def broken(input_shape, num_classes):
      return Tiny(num_classes=-1)

    NUMBER = 3
""")


@pytest.fixture(name="module_file")
def _module_file(tmp_path):
  path = tmp_path / "user_models_for_test.py"
  path.write_text(_SOURCE)
  return str(path)


def _config(spec, **model):
  config = config_lib.base_config()
  config.method = "ntk_dfl"
  config.data.name = "synthetic"
  config.data.partition = "iid"
  config.data.num_clients = 4
  config.data.samples_per_client = 10
  config.topology.degree = 2
  config.rounds = 1
  config.checkpoint_every = 0
  config.eval.selection = False
  config.eval.batch_size = 300
  config.algorithm = config_lib.load_config("ntk_dfl").algorithm
  config.algorithm.taus = (5, 10)
  config.model.module = spec
  for key, value in model.items():
    setattr(config.model, key, value)
  return config


def test_schema_probes_the_factory_with_the_dataset_input(module_file):
  run = schema.validate_config(_config(f"{module_file}:make"))
  assert run.model.module == f"{module_file}:make" and run.model.per_sample is False
  seen = sys.modules[method_modules._file_module_name(module_file)].SEEN  # pylint: disable=protected-access
  assert seen[-1] == ((28, 28, 1), 10)


@pytest.mark.parametrize(
  "attr, message",
  [
    ("nope", "has no attribute 'nope'"),
    ("NUMBER", "'NUMBER' is a int, not a function returning a flax module"),
    ("not_a_module", "the factory returned a str, not a flax.linen.Module"),
    ("wrong_head", "must return logits [B, 10], got (1, 11)"),
  ],
)
def test_a_bad_factory_is_named(module_file, attr, message):
  with pytest.raises(
    ValueError, match="config.model.module = .*" + __import__("re").escape(message)
  ):
    schema.validate_config(_config(f"{module_file}:{attr}"))


@pytest.mark.parametrize(
  "spec, message",
  [
    ("no_such_module_xyz:make", "module 'no_such_module_xyz' could not be imported"),
    ("/no/such/file.py:make", "could not be imported: no such file"),
    ("just_a_module", "must have the form 'package.module:factory'"),
    ("a:b:c", "must have the form"),
    ("mod:", "must have the form"),
  ],
)
def test_a_bad_spec_is_named(spec, message):
  with pytest.raises(ValueError, match=message):
    schema.validate_config(_config(spec))


def test_module_and_a_named_model_conflict(module_file):
  with pytest.raises(ValueError, match="both name a model"):
    schema.validate_config(_config(f"{module_file}:make", name="cnn"))
  with pytest.raises(ValueError, match="config.model.per_sample must be a bool"):
    config = _config(f"{module_file}:make").to_dict()
    config["model"]["per_sample"] = 1
    schema.validate_config(config)


def test_make_model_builds_the_users_module(module_file):
  run = schema.validate_config(_config(f"{module_file}:make", per_sample=True))
  assert not models.flat_inputs(run.model)
  model = models.make_model(run.model, (28, 28, 1), 10)
  assert model.per_sample and model.dense_stack is None and model.input_shape == (28, 28, 1)
  module = user_model.build_module(f"{module_file}:make", (28, 28, 1), 10)
  params = model.init(jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (3, 28, 28, 1))
  np.testing.assert_allclose(model.apply(params, x), module.apply(params, x), rtol=1e-6)
  assert isinstance(module, nn.Module)
  assert (
    models.make_model(
      schema.validate_config(_config(f"{module_file}:make")).model, (28, 28, 1), 10
    ).per_sample
    is False
  )


def test_an_ntk_round_runs_with_the_users_module(module_file, tmp_path):
  workdir = str(tmp_path / "run")
  summary = runner.run(_config(f"{module_file}:make"), workdir)
  line = rundir.read_metrics(workdir)[-1]
  assert line["round"] == 1 and np.isfinite(line["test_loss"]) and 0 <= line["test_acc"] <= 1
  assert summary is not None
  # Reading the run back imports nothing new: only an already imported module is accepted.
  stored = json.loads((tmp_path / "run" / rundir.CONFIG_FILE).read_text())
  stored["model"]["module"] = "never_imported_module_xyz:make"
  (tmp_path / "run" / rundir.CONFIG_FILE).write_text(json.dumps(stored))
  with pytest.raises(ValueError, match="not trusted to import code"):
    rundir.rebuild_config(workdir)
  assert "never_imported_module_xyz" not in sys.modules
