"""The installable package: configs by name, the ``ntk-fl`` command, and a wheel run outside the repository.

The wheel test builds the wheel offline (``pip wheel --no-build-isolation`` with
the setuptools of the test environment), installs it with ``--no-deps`` into a
fresh virtual environment, and runs the smoke config from a directory outside
the checkout. The new environment gets the dependencies through a ``.pth`` file
naming the test environment's ``site-packages`` (a path line of a ``.pth`` file
is appended to ``sys.path``; ``.pth`` files *inside* that folder are not run, so
an editable install of ntk_fl there stays invisible, and the wheel's copy, in
the new environment's own ``site-packages``, comes first). ``venv
--system-site-packages`` would not do here: from inside a virtual environment it
exposes the base interpreter's packages, not the test environment's.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from ntk_fl import config as config_lib
from ntk_fl import configs

REPO = pathlib.Path(__file__).resolve().parent.parent
# What a wheel needs from the checkout (setup.cfg reads README.md and LICENSE).
_WHEEL_SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "ntk_fl")


def _clean_env(**extra) -> dict:
  """The caller's environment without PYTHONPATH (which would put a checkout's ntk_fl first)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return {**env, "JAX_PLATFORMS": "cpu", **extra}


def test_packaged_config_names():
  names = configs.names()
  assert {"ntk_dfl", "ntk_fl", "cp_ntk_fl", "spark", "fed_ensemble", "fedavg", "dfedavg"} <= set(
    names
  )
  assert "__init__" not in names
  assert configs.resolve("ntk_dfl:smoke") == f"{configs.CONFIG_DIR / 'ntk_dfl.py'}:smoke"
  assert configs.resolve("spark") == str(configs.CONFIG_DIR / "spark.py")
  assert configs.resolve("spark:iid,alpha0.5").endswith("spark.py:iid,alpha0.5")
  # Paths (a folder or a .py suffix) are left alone, with or without variants.
  for spec in ("configs/ntk_dfl.py:smoke", "ntk_dfl.py", "/abs/where/x.py:a,b", "sub/ntk_dfl"):
    assert configs.resolve(spec) == spec


def test_unknown_config_name_lists_the_packaged_ones():
  with pytest.raises(ValueError, match=r"unknown config 'ntk_dlf'; packaged configs: .*ntk_dfl"):
    configs.resolve("ntk_dlf:smoke")


def test_load_config_by_name_equals_by_path():
  by_name = config_lib.load_config("ntk_dfl", "smoke,iid")
  by_path = config_lib.load_config(str(REPO / "configs" / "ntk_dfl.py"), "smoke,iid")
  assert by_name.to_dict() == by_path.to_dict()
  assert by_name.data.partition == "iid" and by_name.rounds == by_path.rounds


def test_cli_rewrites_only_the_config_flag():
  from ntk_fl import cli  # pylint: disable=import-outside-toplevel

  argv = [
    "ntk-fl",
    "--config=fedavg:smoke",
    "--config.rounds=3",
    "--workdir=ntk_dfl",
    "--config",
    "spark:iid",
  ]
  out = cli.resolve_config_args(argv)
  assert out[1] == f"--config={configs.CONFIG_DIR / 'fedavg.py'}:smoke"
  assert out[2:5] == argv[2:5]
  assert out[5] == f"{configs.CONFIG_DIR / 'spark.py'}:iid"


def test_cli_unknown_name_is_one_error_line(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "experiments" / "main.py"),
      "--config=no_such_method:smoke",
      f"--workdir={tmp_path / 'run'}",
    ],
    cwd=tmp_path,
    env=_clean_env(PYTHONPATH=str(REPO)),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown config 'no_such_method'")
  assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """The wheel built from a copy of the checkout's package sources (the checkout itself stays clean)."""
  src = tmp_path_factory.mktemp("wheel_src")
  for name in _WHEEL_SOURCES:
    source = REPO / name
    if source.is_dir():
      shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
      shutil.copy2(source, src / name)
  dist = tmp_path_factory.mktemp("dist")
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "wheel",
      "--no-deps",
      "--no-build-isolation",
      "--no-index",
      "-q",
      "-w",
      str(dist),
      str(src),
    ],
    env=_clean_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  (built,) = dist.glob("ntk_fl-*.whl")
  return built


def test_wheel_contents(wheel):
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    metadata = z.read(f"{dist_info}/METADATA").decode()
    license_text = z.read(f"{dist_info}/licenses/LICENSE").decode()
  for name in configs.names():
    assert f"ntk_fl/configs/{name}.py" in names
  assert "ntk_fl/cli.py" in names and "ntk_fl/__main__.py" in names
  # Every module of the package (the command's tools too: config_docs, compare, ...) is shipped.
  for path in (REPO / "ntk_fl").rglob("*.py"):
    assert path.relative_to(REPO).as_posix() in names, path
  from ntk_fl.data import index_map  # pylint: disable=import-outside-toplevel

  for name in (
    index_map.VENDORED_MAPS
  ):  # the authors' partitions and their provenance ship with the package
    assert f"ntk_fl/data/partitions/{name}.npz" in names
  assert "ntk_fl/data/partitions/README.md" in names
  assert "ntk-fl = ntk_fl.cli:main" in entry_points
  assert "Apache License" in license_text and "END OF TERMS AND CONDITIONS" in license_text
  assert (
    "Provides-Extra: cuda12" in metadata and 'jax[cuda12]==0.10.2; extra == "cuda12"' in metadata
  )
  assert "Requires-Dist: tensorboardX" in metadata
  assert "equinox" not in metadata  # not imported by ntk_fl (diffrax brings its own)
  assert not any(n.startswith(("tests/", "experiments/", "benchmarks/")) for n in names)


def test_wheel_runs_the_smoke_config_outside_the_repository(wheel, tmp_path):
  venv = tmp_path / "venv"
  subprocess.run(
    [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
  )
  python = venv / "bin" / "python"
  site = subprocess.run(
    [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    check=True,
    capture_output=True,
    text=True,
  ).stdout.strip()
  (pathlib.Path(site) / "ntk_fl_test_dependencies.pth").write_text(
    sysconfig.get_paths()["purelib"] + "\n"
  )
  install = subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "--python",
      str(python),
      "install",
      "--no-deps",
      "--no-index",
      "-q",
      str(wheel),
    ],
    env=_clean_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]

  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  where = subprocess.run(
    [str(python), "-c", "import ntk_fl; print(ntk_fl.__file__)"],
    cwd=elsewhere,
    env=_clean_env(),
    check=True,
    capture_output=True,
    text=True,
  ).stdout.strip()
  assert where.startswith(site), f"ntk_fl imported from {where}, not from the wheel in {site}"

  helpshort = subprocess.run(
    [str(venv / "bin" / "ntk-fl"), "--helpshort"],
    cwd=elsewhere,
    env=_clean_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert "runs one experiment from a config" in helpshort.stdout  # (absl exits 1 after help)
  for flag in ("--config:", "--workdir:", "--[no]resume:", "--branch_from:"):
    assert flag in helpshort.stdout, helpshort.stdout

  proc = subprocess.run(
    [str(venv / "bin" / "ntk-fl"), "--config=ntk_dfl:smoke", "--workdir=runs/smoke"],
    cwd=elsewhere,
    env=_clean_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  run = elsewhere / "runs" / "smoke"
  for name in (
    "metrics.jsonl",
    "summary.json",
    "config.json",
    "accuracy.png",
    "selection.png",
    "log.txt",
  ):
    assert (run / name).is_file(), sorted(p.name for p in run.iterdir())
  assert list(run.glob("events.out.tfevents.*")), "no TensorBoard event file"
  assert "final aggregated accuracy" in proc.stdout
  summary = json.loads((run / "summary.json").read_text())
  lines = (run / "metrics.jsonl").read_text().splitlines()
  rounds = config_lib.load_config("ntk_dfl", "smoke").rounds
  assert summary["rounds_run"] == rounds and len(lines) == rounds
  assert 0.5 < summary["final_test_acc"] <= 1.0
  assert json.loads((run / "config.json").read_text())["method"] == "ntk_dfl"


def test_sdist_ships_the_docs_examples_and_pins(tmp_path):
  import tarfile  # pylint: disable=import-outside-toplevel

  source = tmp_path / "src"
  skip = shutil.ignore_patterns(
    ".venv", ".git", "__pycache__", "*.egg-info", "runs", "build", "dist", ".pytest_cache"
  )
  shutil.copytree(REPO, source, ignore=skip, symlinks=True)
  (source / "docs" / "api").mkdir(exist_ok=True)
  (source / "docs" / "api" / "index.html").write_text("generated")
  out = tmp_path / "dist"
  build = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
  subprocess.run(
    [sys.executable, "-c", build, str(out)],
    cwd=source,
    check=True,
    capture_output=True,
    env=_clean_env(),
    timeout=300,
  )
  (sdist,) = out.glob("ntk_fl-*.tar.gz")
  with tarfile.open(sdist) as tar:
    names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
  for name in (
    "docs/REPRODUCTION.md",
    "docs/ARCHITECTURE.md",
    "experiments/main.py",
    "scripts/setup.sh",
    "scripts/build_docs.sh",
    "scripts/build_docs.py",
    "requirements/constraints.txt",
    "tests/test_package.py",
    "ntk_fl/cli.py",
    "ntk_fl/config_docs.py",
    "README.md",
  ):
    assert name in names, name
  assert any(n.startswith("docs/figures/") and n.endswith(".png") for n in names)
  assert not any(n.startswith("docs/api") for n in names)  # built by scripts/build_docs.sh
  assert not any("__pycache__" in n for n in names)
