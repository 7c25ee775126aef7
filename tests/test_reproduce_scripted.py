"""Experiments made by a script (``ntk_fl.reproduce.scripted``): run once, kept only when complete,
skipped when finished, rendered from the script's own table and figures."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from ntk_fl import reproduce
from ntk_fl.reproduce import EXPERIMENTS, scripted
from ntk_fl.reproduce.registry import Experiment, Script

# A stand-in for an experiments/ script: writes its outputs into --out, counts its calls in --calls,
# and fails on request (exit status, or success without one of its files).
FAKE = textwrap.dedent(
  """
  import argparse, os, sys
  p = argparse.ArgumentParser()
  p.add_argument("--out"); p.add_argument("--calls"); p.add_argument("--fail", default="")
  a = p.parse_args()
  with open(a.calls, "a") as f:
    f.write("x")
  os.makedirs(a.out, exist_ok=True)
  if a.fail == "status":
    sys.exit(3)
  with open(os.path.join(a.out, "table.md"), "w") as f:
    f.write("| K | bias |\\n|---|---|\\n| 1 | 0.11 |\\n")
  if a.fail != "missing":
    with open(os.path.join(a.out, "figure.png"), "wb") as f:
      f.write(b"not really a png")
  print("the fake script ran")
  """
)


def _experiment(tmp_path, *extra_args: str) -> Experiment:
  script = tmp_path / "fake_script.py"
  script.write_text(FAKE)
  return Experiment(
    "test:fake",
    "A fake script experiment",
    (),
    claim="it writes a table",
    script=Script(
      str(script),  # absolute: os.path.join(root, path) keeps it
      ("--out={out}", f"--calls={tmp_path / 'calls'}", *extra_args),
      ("table.md", "figure.png"),
      cpu_minutes=2,
    ),
  )


def _calls(tmp_path) -> int:
  path = tmp_path / "calls"
  return len(path.read_text()) if path.exists() else 0


@pytest.fixture
def fake(tmp_path, monkeypatch):
  experiment = _experiment(tmp_path)
  monkeypatch.setitem(EXPERIMENTS, experiment.name, experiment)
  return experiment


def test_a_script_experiment_runs_once_then_is_skipped_and_renders(tmp_path, fake, capsys):
  out = str(tmp_path / "out")
  assert reproduce.main(["test:fake", "--status", "--out", str(tmp_path)]) == 0
  assert "not started" in capsys.readouterr().out
  assert reproduce.main(["test:fake", "--out", out]) == 0
  assert _calls(tmp_path) == 1
  folder = os.path.join(out, "test_fake")
  assert sorted(os.listdir(folder)) == ["figure.png", scripted.PROVENANCE_FILE, "table.md"]
  assert not os.path.exists(folder + ".partial")
  with open(folder + ".log") as f:
    assert "the fake script ran" in f.read()
  provenance = json.load(open(os.path.join(folder, scripted.PROVENANCE_FILE)))
  # The command reads for the kept folder, and re-running it makes the same files there.
  assert f"--out={os.path.abspath(folder)}" in provenance["command"]
  assert provenance["seconds"] >= 0 and "CPU cores" in provenance["machine"]
  page = (tmp_path / "out" / "results" / "test_fake.md").read_text()
  assert page.startswith("# test:fake: A fake script experiment")
  assert "Paper: it writes a table" in page and "| 1 | 0.11 |" in page
  assert "![figure.png](test_fake_figure.png)" in page
  assert (tmp_path / "out" / "results" / "test_fake_figure.png").read_bytes() == b"not really a png"
  capsys.readouterr()

  assert reproduce.main(["test:fake", "--out", out]) == 0  # finished: skipped, rendered again
  assert _calls(tmp_path) == 1
  assert "skip:" in capsys.readouterr().out
  assert reproduce.main(["test:fake", "--status", "--out", out]) == 0
  assert "| finished | — |" in capsys.readouterr().out
  assert reproduce.main(["--status", "--out", out]) == 0
  assert "| test:fake | 1 | 0 | 0 | — | — | — |" in capsys.readouterr().out


def test_a_failed_script_leaves_nothing_that_reads_as_finished(tmp_path, monkeypatch, capsys):
  out = str(tmp_path / "out")
  for fail, why in (("status", "exit status 3"), ("missing", "it wrote no figure.png")):
    experiment = _experiment(tmp_path, f"--fail={fail}")
    monkeypatch.setitem(EXPERIMENTS, experiment.name, experiment)
    assert reproduce.main(["test:fake", "--out", out]) == 1
    err = capsys.readouterr().err
    assert why in err and "test_fake.log" in err
    assert not os.path.exists(os.path.join(out, "test_fake"))
    assert scripted.state(experiment, out) == "not started"
  # Rendering before it has finished is refused, naming the command that makes it.
  assert reproduce.main(["test:fake", "--out", out, "--render_only"]) == 2
  assert f"run `ntk-fl reproduce test:fake --out {out}`" in capsys.readouterr().err
  # The next attempt (the script mended) starts afresh over the killed attempt's .partial folder.
  assert os.path.isdir(os.path.join(out, "test_fake.partial"))
  experiment = _experiment(tmp_path)
  monkeypatch.setitem(EXPERIMENTS, experiment.name, experiment)
  assert reproduce.main(["test:fake", "--out", out]) == 0
  assert scripted.state(experiment, out) == "finished" and _calls(tmp_path) == 3


def test_an_incomplete_output_folder_is_moved_aside_not_overwritten(tmp_path, fake, capsys):
  out = tmp_path / "out"
  (out / "test_fake").mkdir(parents=True)
  (out / "test_fake" / "table.md").write_text("edited by hand")
  assert scripted.state(fake, str(out)) == "incomplete"
  assert reproduce.main(["test:fake", "--out", str(out), "--dry_run"]) == 0
  assert f"start (move aside {out / 'test_fake'})" in capsys.readouterr().out
  assert _calls(tmp_path) == 0
  assert reproduce.main(["test:fake", "--out", str(out)]) == 0
  (aside,) = [d for d in os.listdir(out) if d.startswith("test_fake.unfinished-")]
  assert (out / aside / "table.md").read_text() == "edited by hand"
  assert scripted.state(fake, str(out)) == "finished"


def test_run_flags_and_a_missing_source_tree_are_refused(tmp_path, fake, monkeypatch, capsys):
  for flags in (["--seeds", "1"], ["--variants", "x"], ["--replicas", "2"], ["--skip_gpu"]):
    assert reproduce.main(["test:fake", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} do not apply" in err and "not by runs" in err
  # An installation without the source tree beside it (a wheel): the script is not found.
  moved = Experiment(
    "test:fake", "x", (), script=Script("experiments/no_such_script.py", (), ("a.md",), 1)
  )
  monkeypatch.setitem(EXPERIMENTS, moved.name, moved)
  assert reproduce.main(["test:fake", "--out", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert "experiments/no_such_script.py of the source tree" in err
  assert "run it from a clone of the repository" in err


def test_python_and_extra_reach_the_script(tmp_path, fake):
  command = scripted.command(fake, "/tmp/x", python="nice -n 5 python3", extra=("--fail=",))
  assert command[:4] == ["nice", "-n", "5", "python3"]
  assert command[4] == fake.script.path and command[-1] == "--fail="
  assert "--out=/tmp/x" in command
  assert scripted.command(fake, "/tmp/x")[0] == sys.executable


def test_the_registered_scripts_and_their_files_exist():
  # Each registered script is in the source tree, with every file its arguments name, and --list
  # shows it with its time.
  scripts = {n: e for n, e in EXPERIMENTS.items() if e.script is not None}
  assert {"ntk_fl:fig8", "ntk_dfl:fig17", "fed_ensemble:table1"} <= set(scripts)
  listing = reproduce.list_table()
  for name, experiment in scripts.items():
    assert not experiment.variants and not experiment.needs, name
    assert os.path.isfile(scripted.script_path(experiment))
    assert any(o.endswith(".md") for o in experiment.script.outputs), name
    for arg in experiment.script.args:
      _, _, value = arg.partition("=")
      if value.startswith(("configs/", "experiments/")):
        assert os.path.isfile(os.path.join(scripted.source_root(), value)), arg
    assert f"| {name} | {experiment.title} | script |" in listing


def test_the_projection_benchmark_tabulates_its_rows_against_ntk_dfl(tmp_path):
  # spark:fig10's script: the table's ratios are each row over the NTK-DFL row; bad sizes are refused.
  from scripts import load_benchmark  # pylint: disable=import-outside-toplevel

  bench = load_benchmark("spark_projection")
  rows = [
    {"name": name, "seconds": s, "peak_mb": m, "memory": "process RSS"}
    for (name, _, _), s, m in zip(
      bench.ROWS, (2.0, 3.0, 1.0, 1.5, 2.5, 40.0), (600, 660, 500, 520, 540, 5000)
    )
  ]
  result = {
    "machine": "m",
    "jax": "0",
    "backend": "cpu",
    "settings": {
      "clients": 10,
      "degree": 5,
      "chunk": 1,
      "tau_max": 800,
      "repeats": 1,
      "variant": "",
    },
    "rows": rows,
  }
  table = bench.markdown(result)
  assert "| NTK-DFL | 2.00 | 1.00 | 600 | 1.00 |" in table
  assert "| SPARK, layer-wise, cap 500 | 1.00 | 0.50 | 500 | 0.83 |" in table
  assert "| SPARK, flattened, k_proj = 10,000 | 40.00 | 20.00 | 5,000 | 8.33 |" in table
  bench.plot(result, str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 0
  for argv, message in (
    (["--clients=0"], "--clients must be a positive integer, got 0"),
    (["--tau-max=150"], "--tau-max must be a multiple of 100"),
  ):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
      bench.main([f"--out={tmp_path / 'x'}", *argv])
  assert not (tmp_path / "x").exists()
