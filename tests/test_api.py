"""The README's functional-API example runs as written and learns (synthetic data, seconds)."""
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
