"""The README's functional-API and own-method examples run as written and learn (Fashion-MNIST slices, seconds)."""
import json
import pathlib
import re

import numpy as np

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
  assert accuracy > 0.5, accuracy                    # 10 classes: chance is 0.1
  taus = np.asarray(namespace["round_metrics"]["tau"])
  assert taus.shape == (namespace["config"].data.num_clients,)
  assert set(taus.tolist()) <= set(namespace["config"].algorithm.taus)


def own_method_example() -> str:
  text = (REPO / "README.md").read_text()
  match = re.search(r"## Write your own method.*?```python\n(.*?)```", text, re.S)
  assert match, "README has no 'Write your own method' example"
  return match.group(1)


def _run_own_method(tmp_path, monkeypatch, beta: float | None = None) -> tuple[dict, list[dict]]:
  """Runs the README's own-method code in ``tmp_path`` (optionally with another ``BETA``)."""
  from ntk_fl import rundir  # pylint: disable=import-outside-toplevel

  code = own_method_example()
  if beta is not None:
    code, count = re.subn(r"^BETA = [0-9.]+", f"BETA = {beta!r}", code, flags=re.M)
    assert count == 1
  monkeypatch.chdir(tmp_path)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["summary"], rundir.read_metrics(str(tmp_path / "runs" / "ntk_dfl_mix"))


def test_readme_own_method_with_beta_zero_is_ntk_dfl(tmp_path, monkeypatch):
  """BETA = 0 leaves the hard labels as targets: the new method is NTK-DFL's smoke run (tests/golden)."""
  _, lines = _run_own_method(tmp_path, monkeypatch, beta=0.0)
  golden = json.loads((REPO / "tests" / "golden" / "ntk_dfl.json").read_text())["rounds"]
  assert len(lines) == len(golden)
  for line, want in zip(lines, golden):
    np.testing.assert_array_equal(line["clients"]["tau"], want["clients_tau"])
    # The same computation in the same order: equal up to the golden test's float32 tolerance (tests/test_golden.py).
    np.testing.assert_allclose(line["clients"]["loss"], want["clients_loss"], rtol=1e-4)
    np.testing.assert_allclose(line["test_acc"], want["test_acc"], atol=2 / 2_000)


def test_readme_own_method_runs_through_the_runner_and_learns(tmp_path, monkeypatch):
  summary, lines = _run_own_method(tmp_path, monkeypatch)
  assert summary["final_test_acc"] > 0.5, summary["final_test_acc"]     # 10 classes: chance is 0.1
  assert summary["method"] == "ntk_dfl_mix"
  golden = json.loads((REPO / "tests" / "golden" / "ntk_dfl.json").read_text())["rounds"]
  # The soft part of the targets changes the evolution: some client's selected loss differs from NTK-DFL's.
  assert any(not np.allclose(line["clients"]["loss"], want["clients_loss"], rtol=1e-3)
             for line, want in zip(lines, golden))
