"""The config boundary: a run config is checked once, at ntk_fl.schema, and travels on as typed settings.

* Below the schema no module imports ml_collections (an AST scan of the package).
* Every shipped config becomes frozen RunSettings whose config form is the config again (nothing lost,
  nothing invented), with the method's own hyperparameter dataclass.
* A whole run checks its config once and builds its topology once.
* Hyperparameters built in Python are checked on construction like those from a config.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from ntk_fl import config as config_lib
from ntk_fl import runner, schema, settings, topology
from ntk_fl.algorithms import get_method
from ntk_fl.algorithms.ntk_dfl import NTKDFLHParams

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ntk_fl"
# The config layer: the config schema, the presets and config files, and the command line that reads config
# files with ml_collections' config_flags. Everything else receives typed settings.
CONFIG_LAYER = {"config.py", "schema.py", "cli.py"}


def _imports_ml_collections(path: pathlib.Path) -> bool:
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import) and any(
      a.name.split(".")[0] == "ml_collections" for a in node.names
    ):
      return True
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ml_collections":
      return True
  return False


def test_no_module_below_the_schema_imports_ml_collections():
  offenders = [
    str(p.relative_to(PACKAGE))
    for p in sorted(PACKAGE.rglob("*.py"))
    if p.relative_to(PACKAGE).parts[0] != "configs"
    and str(p.relative_to(PACKAGE)) not in CONFIG_LAYER
    and _imports_ml_collections(p)
  ]
  assert not offenders, f"modules below the config schema import ml_collections: {offenders}"
  assert _imports_ml_collections(PACKAGE / "schema.py")  # the scan does see an import


def _shipped_configs():
  return sorted(
    p.stem
    for p in (PACKAGE / "configs").glob("*.py")
    if not p.stem.startswith("_") and p.stem != "fed_ensemble_toy"
  )  # the toy is no federated run


@pytest.mark.parametrize("name", _shipped_configs())
def test_every_shipped_config_becomes_frozen_settings_that_round_trip(name):
  config = config_lib.load_config(str(PACKAGE / "configs" / f"{name}.py"))
  run = schema.validate_config(config)
  assert isinstance(run, settings.RunSettings)
  assert isinstance(run.algorithm, get_method(config.method).hyperparameters)
  assert settings.to_dict(run) == config.to_dict()  # the typed form is the config, nothing else
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.algorithm.lr = 1.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.data.num_clients = 1
  assert schema.validate_config(run) is run  # settings are not checked twice
  assert (run.built_topology is not None) == get_method(config.method).graph


def test_missing_and_unknown_algorithm_keys_are_named():
  config = config_lib.load_config(str(PACKAGE / "configs" / "ntk_dfl.py"))
  del config.algorithm["subsample"]
  config.algorithm.subsampel = 2
  message = r"config.algorithm \(method 'ntk_dfl'\): unknown key\(s\) \['subsampel'\], missing key\(s\) \['subsample'\]"
  with pytest.raises(ValueError, match=message):
    schema.validate_config(config)


def test_hyperparameters_built_in_python_are_checked_on_construction():
  good = dict(
    lr=0.01,
    lr_decay=0.07,
    taus=(100, 200),
    loss="ce",
    solver="euler",
    select="network",
    kernel="traced",
    per_round_averaging=True,
    jacobian_batches=1,
    subsample=1,
  )
  assert NTKDFLHParams(**good).taus == (100, 200)
  for field, value, match in (
    ("lr", -1.0, "config.algorithm.lr"),
    ("taus", (200, 100), "taus"),
    ("solver", "rk4", "solver"),
    ("subsample", 0, "subsample"),
  ):
    with pytest.raises(ValueError, match=match):
      NTKDFLHParams(**{**good, field: value})


def test_a_run_checks_its_config_once_and_builds_its_topology_once(tmp_path, monkeypatch):
  """Through the command line's path (schema, then the workdir check, then the run), one check and one build."""
  parses, builds = [], []
  parse, make_topology = schema.validate_config, topology.make_topology

  def counting_parse(config):
    if not isinstance(config, settings.RunSettings):
      parses.append(config)
    return parse(config)

  def counting_topology(*args, **kwargs):
    builds.append(args)
    return make_topology(*args, **kwargs)

  monkeypatch.setattr(topology, "make_topology", counting_topology)
  for module in (schema, runner):
    monkeypatch.setattr(module, "validate_config", counting_parse)
  config = config_lib.load_config(str(REPO / "tests" / "configs" / "toy.py"), "smoke")
  config.rounds, config.eval.selection, config.checkpoint_every = 1, False, 0
  run = schema.validate_config(config)
  runner.rundir.check_start(run, str(tmp_path))
  summary = runner.run(run, str(tmp_path))
  assert summary["rounds_run"] == 1
  assert len(parses) == 1 and len(builds) == 1


# ------------------------------------------------------------------------ settings without effect


def _warnings_for(name, variant, **overrides):
  """The ignored-setting messages of ``name:variant`` with ``overrides`` ('data.alpha': 0.5)."""
  reference = config_lib.load_config(name, variant)
  config = config_lib.load_config(name, variant)
  for path, value in overrides.items():
    *parents, leaf = path.split(".")
    block = config
    for parent in parents:
      block = block[parent]
    block[leaf] = value
  changed = schema.changed_fields(config, reference)
  return schema.ignored_settings(schema.validate_config(config), changed)


@pytest.mark.parametrize(
  "name, variant, field, value, reason",
  [
    ("ntk_dfl", "smoke,iid", "data.alpha", 0.5, "data.partition = 'iid'"),
    ("ntk_dfl", "smoke", "data.classes_per_client", 3, "only 'shards' reads it"),
    ("ntk_dfl", "smoke,contiguous", "data.alpha", 0.3, "data.partition = 'contiguous'"),
    ("ntk_dfl", "smoke,clustered", "topology.degree", 3, "topology.name = 'clustered'"),
    ("ntk_dfl", "smoke", "topology.mean_degree", 3.0, "topology.name = 'regular'"),
    ("ntk_dfl", "smoke", "topology.cluster_size", 4, "only 'clustered' reads it"),
    ("fedavg", "smoke", "topology.degree", 3, "method 'fedavg' does not mix over a graph"),
    ("dfedavg", "smoke", "algorithm.nesterov", True, "algorithm.momentum = 0"),
    ("dfedavg", "smoke", "algorithm.stochastic_rounding", True, "algorithm.quantize_bits = 32"),
    (
      "spark",
      "smoke,abl_momentum",
      "algorithm.distill.warmup_rounds",
      3,
      "algorithm.distill.enabled = False",
    ),
    ("spark", "smoke", "algorithm.projection.k_proj", 100, "algorithm.projection.scheme = 'none'"),
    ("spark", "smoke", "algorithm.lr_boost.factor", 2.0, "no round is boosted"),
    ("fed_ensemble", "smoke", "algorithm.taus", (10, 20), "algorithm.local_training = 'fedavg'"),
  ],
)
def test_a_changed_setting_that_nothing_reads_is_named(name, variant, field, value, reason):
  messages = _warnings_for(name, variant, **{field: value})
  assert len(messages) == 1, messages
  assert messages[0].startswith(f"config.{field} = {value!r} has no effect: "), messages
  assert reason in messages[0], messages


@pytest.mark.parametrize(
  "name, variant, field, value",
  [
    ("ntk_dfl", "smoke", "data.alpha", 0.5),  # dirichlet_fixed_size reads it
    ("ntk_dfl", "smoke,iid", "data.samples_per_client", 50),  # iid reads it
    ("ntk_dfl", "smoke", "topology.degree", 4),  # regular reads it
    ("ntk_dfl", "smoke,clustered", "topology.cluster_size", 5),
    ("dfedavgm", "smoke", "algorithm.nesterov", True),  # momentum 0.9
    ("spark", "smoke", "algorithm.distill.warmup_rounds", 2),  # distillation on
    ("ntk_dfl", "smoke", "algorithm.lr", 0.02),
  ],
)
def test_a_changed_setting_that_is_read_passes_silently(name, variant, field, value):
  assert _warnings_for(name, variant, **{field: value}) == []


def test_only_changed_settings_are_named():
  # An IID config carries alpha = 0.1 and a regular graph's degree; a variant's settings are the
  # config's own.
  assert _warnings_for("ntk_dfl", "smoke,iid") == []
  assert _warnings_for("ntk_dfl", "smoke,clustered") == []  # smoke's degree: clustered ignores it
  assert _warnings_for("ntk_dfl", "authors_alpha0.3") == []  # alpha labels the shipped map
  # A field set back to the reference's value counts as unchanged; lists and tuples compare equal.
  assert _warnings_for("ntk_dfl", "smoke,iid", **{"data.alpha": 0.1}) == []
  assert schema.changed_fields({"a": {"b": [1, 2]}, "c": 1}, {"a": {"b": (1, 2)}, "c": 2}) == {"c"}


def test_the_command_line_warns_before_loading_data(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  empty = tmp_path / "empty"
  empty.mkdir()
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(REPO),
    "NTK_FL_DATA_DIR": str(empty),
  }
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "ntk_fl",
      "--config=ntk_dfl:smoke,iid",
      "--config.data.alpha=0.5",
      "--config.algorithm.lr=0.02",
      "--config.data.name=cifar10",
      f"--config.data.data_dir={empty}",
      f"--workdir={tmp_path / 'run'}",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert proc.returncode == 1
  warnings = [line for line in proc.stderr.splitlines() if "has no effect" in line]
  assert len(warnings) == 1, proc.stderr
  assert "config.data.alpha = 0.5 has no effect: data.partition = 'iid'" in warnings[0]


# ------------------------------------------------------------------------ a chosen neighbour bound


def _erdos_renyi_smoke(rounds, k_max, dynamic=True):
  config = config_lib.load_config("dfedavg", "smoke")
  config.topology.name, config.topology.mean_degree = "erdos_renyi", 5.0
  config.topology.k_max, config.topology.dynamic, config.rounds = k_max, dynamic, rounds
  return config


def test_a_chosen_k_max_too_small_for_a_later_round_is_refused_before_the_run():
  config = _erdos_renyi_smoke(1, 0)
  derived = topology.make_topology(
    "erdos_renyi", config.data.num_clients, seed=config.seed, mean_degree=5.0
  )
  degrees = [int(derived.sample(r).mask.sum(axis=1).max()) for r in range(40)]
  # the first round whose graph has a larger degree than every round before it
  late = next(r for r in range(1, 40) if degrees[r] > max(degrees[:r]))
  bound = max(degrees[:late])
  assert schema.validate_config(_erdos_renyi_smoke(late, bound)).built_topology.k_max == bound
  with pytest.raises(ValueError, match=rf"k_max = {bound} is too small.*round {late}: .*degree"):
    schema.validate_config(_erdos_renyi_smoke(late + 1, bound))
  # a static graph is round 0's graph in every round
  schema.validate_config(_erdos_renyi_smoke(late + 1, degrees[0], dynamic=False))
