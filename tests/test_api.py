"""The README's functional-API and own-method examples run as written and learn (Fashion-MNIST slices, seconds)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def readme_example() -> str:
  text = (REPO / "README.md").read_text()
  match = re.search(r"## Functional API.*?```python\n(.*?)```", text, re.S)
  assert match, "README has no functional-API example"
  return match.group(1)


def test_readme_functional_api_example_runs_and_learns(monkeypatch):
  monkeypatch.chdir(REPO)
  namespace = {}
  exec(compile(readme_example(), "README.md", "exec"), namespace)  # pylint: disable=exec-used
  accuracy = float(namespace["accuracy"])
  assert accuracy > 0.5, accuracy  # 10 classes: chance is 0.1
  taus = np.asarray(namespace["round_metrics"]["tau"])
  assert taus.shape == (namespace["config"].data.num_clients,)
  assert set(taus.tolist()) <= set(namespace["config"].algorithm.taus)


def own_method_example() -> str:
  text = (REPO / "README.md").read_text()
  match = re.search(r"## Write your own method.*?```python\n(.*?)```", text, re.S)
  assert match, "README has no 'Write your own method' example"
  return match.group(1)


# Rounds of the runs that are compared round for round with NTK-DFL's: a setting the method dropped, or a
# state it did not carry over, shows in the first round and the next; a third round repeats the second's
# code on new numbers. The README's code as written (three rounds, checkpoints, selection curves) runs in
# test_readme_own_method_runs_through_the_runner_and_learns.
COMPARED_ROUNDS = 2


def _compared(config) -> None:
  """The run settings of a compared run: ``COMPARED_ROUNDS`` rounds; no checkpoints or selection curves
  (written after a round's metrics line and after the run: neither changes a metric)."""
  config.rounds = COMPARED_ROUNDS
  config.checkpoint_every = 0
  config.eval.selection = False


def _run_own_method(
  tmp_path, monkeypatch, beta: float | None = None, variant: str = "", compared: bool = False
) -> tuple[dict, list[dict]]:
  """Runs the README's own-method code in ``tmp_path`` (optionally with another ``BETA`` and config
  variant; ``compared``: with :func:`_compared`'s settings)."""
  from ntk_fl import rundir  # pylint: disable=import-outside-toplevel

  code = own_method_example()
  if beta is not None:
    code, count = re.subn(r"^BETA = [0-9.]+", f"BETA = {beta!r}", code, flags=re.M)
    assert count == 1
  if variant:
    code, count = re.subn(
      r'load_config\("ntk_dfl", "smoke"\)', f'load_config("ntk_dfl", "smoke,{variant}")', code
    )
    assert count == 1
  if compared:
    code, count = re.subn(
      r'^(config\.method = "ntk_dfl_mix")', r"\1; _compared(config)", code, flags=re.M
    )
    assert count == 1
  monkeypatch.chdir(tmp_path)
  namespace = {"_compared": _compared}
  exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["summary"], rundir.read_metrics(str(tmp_path / "runs" / "ntk_dfl_mix"))


def _ntk_dfl_lines(tmp_path, variant: str) -> list[dict]:
  """NTK-DFL's own smoke run on ``variant`` (the reference the README's method must reproduce)."""
  from ntk_fl import rundir, runner  # pylint: disable=import-outside-toplevel
  from ntk_fl.config import load_config  # pylint: disable=import-outside-toplevel

  workdir = str(tmp_path / f"ntk_dfl_{variant}")
  config = load_config("ntk_dfl", f"smoke,{variant}")
  _compared(config)
  runner.run(config, workdir)
  return rundir.read_metrics(workdir)


def _golden_ntk_dfl() -> list[dict]:
  return json.loads((REPO / "tests" / "golden" / "ntk_dfl.json").read_text())["rounds"]


def test_readme_own_method_with_beta_zero_is_ntk_dfl(tmp_path, monkeypatch):
  """BETA = 0 leaves the hard labels as targets: the new method is NTK-DFL's smoke run (tests/golden),
  round for round over its first ``COMPARED_ROUNDS`` rounds."""
  _, lines = _run_own_method(tmp_path, monkeypatch, beta=0.0, compared=True)
  golden = _golden_ntk_dfl()
  assert len(lines) == COMPARED_ROUNDS < len(golden)
  for line, want in zip(lines, golden):
    np.testing.assert_array_equal(line["clients"]["tau"], want["clients_tau"])
    # The same computation in the same order: equal up to the golden test's float32 tolerance (tests/test_golden.py).
    np.testing.assert_allclose(line["clients"]["loss"], want["clients_loss"], rtol=1e-4)
    np.testing.assert_allclose(line["test_acc"], want["test_acc"], atol=2 / 2_000)


def test_readme_own_method_keeps_every_setting(tmp_path, monkeypatch):
  """On a non-default variant the README's method with the identity hook (BETA = 0) is NTK-DFL on that
  variant, round for round: the loss, the Jacobian blocks and the sub-sampling all reach the client step.

  One variant sets all three (one pair of runs, not a pair per setting): a setting the method dropped would
  still make its run differ from NTK-DFL's, which takes every one of them."""
  variant = "mse,batched,subsample"
  _, lines = _run_own_method(tmp_path, monkeypatch, beta=0.0, variant=variant, compared=True)
  reference = _ntk_dfl_lines(tmp_path, variant)
  assert len(lines) == len(reference) == COMPARED_ROUNDS
  for line, want in zip(lines, reference):
    np.testing.assert_array_equal(line["clients"]["tau"], want["clients"]["tau"])
    np.testing.assert_allclose(line["clients"]["loss"], want["clients"]["loss"], rtol=1e-6)
    assert line["test_acc"] == want["test_acc"]
  # ... and the setting changed the run: its losses are not cross-entropy's unbatched full-data ones.
  assert any(
    not np.allclose(line["clients"]["loss"], want["clients_loss"], rtol=1e-3)
    for line, want in zip(lines, _golden_ntk_dfl())
  )


def test_readme_own_method_runs_through_the_runner_and_learns(tmp_path, monkeypatch):
  summary, lines = _run_own_method(tmp_path, monkeypatch)
  assert summary["final_test_acc"] > 0.5, summary["final_test_acc"]  # 10 classes: chance is 0.1
  assert summary["method"] == "ntk_dfl_mix"
  golden = _golden_ntk_dfl()
  # The soft part of the targets changes the evolution: some client's selected loss differs from NTK-DFL's.
  assert any(
    not np.allclose(line["clients"]["loss"], want["clients_loss"], rtol=1e-3)
    for line, want in zip(lines, golden)
  )


_LABEL_SMOOTHING_METHOD = """
import dataclasses
from ntk_fl import algorithms
from ntk_fl.algorithms import ntk_dfl


@dataclasses.dataclass(frozen=True)
class SmoothHParams(ntk_dfl.NTKDFLHParams):
  eps: float = 0.1

  def __post_init__(self):
    super().__post_init__()
    if not 0 <= self.eps < 1:
      raise ValueError(f"config.algorithm.eps must be in [0, 1), got {self.eps!r}")


def make(model, federation, topology, hparams, run):
  smooth = lambda f0, hard: (1 - hparams.eps) * hard + hparams.eps / hard.shape[-1]
  return ntk_dfl.make_ntk_dfl(model, federation, topology, hparams, run, targets_fn=smooth)


algorithms.register("ntk_dfl_smooth", algorithms.Method(make=make, hyperparameters=SmoothHParams, graph=True))
"""


def test_own_hyperparameter_is_set_from_the_command_line(tmp_path):
  """A subclassed hyperparameter dataclass's field (``eps``) is a ``--config.algorithm.<key>`` like any other;
  a key neither the file nor the method has is refused by name."""
  module = tmp_path / "smooth_method.py"
  module.write_text(_LABEL_SMOOTHING_METHOD)
  base = [
    sys.executable,
    "-m",
    "ntk_fl",
    "--config=ntk_dfl:smoke",
    "--config.method=ntk_dfl_smooth",
    f"--config.method_module={module}",
    "--config.rounds=1",
  ]
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  proc = subprocess.run(
    [*base, "--config.algorithm.eps=0.25", f"--workdir={tmp_path / 'run'}"],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  stored = json.loads((tmp_path / "run" / "config.json").read_text())
  assert stored["algorithm"]["eps"] == 0.25 and stored["method"] == "ntk_dfl_smooth"
  proc = subprocess.run(
    [*base, "--config.algorithm.epz=0.25", f"--workdir={tmp_path / 'bad'}"],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    check=False,
  )
  assert proc.returncode != 0
  assert (
    "unknown config key config.algorithm.epz; did you mean config.algorithm.eps?" in proc.stderr
  ), proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_a_graph_method_registered_without_graph_fails_early_and_clearly():
  from ntk_fl import algorithms, runner  # pylint: disable=import-outside-toplevel
  from ntk_fl.algorithms import ntk_dfl  # pylint: disable=import-outside-toplevel
  from ntk_fl.config import load_config  # pylint: disable=import-outside-toplevel

  algorithms.register(
    "ntk_dfl_no_graph",
    algorithms.Method(make=ntk_dfl.make_ntk_dfl, hyperparameters=ntk_dfl.NTKDFLHParams),
  )
  config = load_config("ntk_dfl", "smoke")
  config.method = "ntk_dfl_no_graph"
  with pytest.raises(ValueError, match="graph=True"):
    runner.build_experiment(config)


@pytest.mark.parametrize(
  "run",
  [
    "authors_partitions/ntk_dfl_authors_a0.1_s0",
    "spark_ablation/abl_distill_s0",
    "fed_ensemble_gap/k1_e2",
    "ntk_fl_partitions/ntk_a0.1d0_s2",
  ],
)
def test_stored_configs_load_with_enum_options_and_store_plain_strings(run):
  """Run directories written before the options were enums still load; their enum fields become members
  and turn back into the same plain strings in JSON."""
  from ntk_fl import rundir, schema, settings  # pylint: disable=import-outside-toplevel
  from ntk_fl._src.options import Choice  # pylint: disable=import-outside-toplevel

  workdir = str(REPO / "docs" / "runs" / run)
  stored = json.loads(pathlib.Path(workdir, "config.json").read_text())
  run_settings = schema.validate_config(rundir.rebuild_config(workdir))
  hparams = run_settings.algorithm
  enums = {k: v for k, v in vars(hparams).items() if isinstance(v, Choice)}
  assert enums, hparams
  dumped = json.loads(json.dumps(settings.to_dict(hparams)))  # what a new config.json holds
  for name, value in enums.items():
    assert value.value == dumped[name] and type(dumped[name]) is str
    # A field added after the run was stored takes its default (rundir.rebuild_config fills it in).
    assert stored["algorithm"].get(name, value.value) == value.value
