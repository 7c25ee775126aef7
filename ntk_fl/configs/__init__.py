"""The paper configs, one ``get_config(arg)`` file per method (ml_collections), shipped inside the package.

A config is named either by its method (``ntk_dfl``, ``spark:iid``: the file of
that name in this package) or by a path to any config file (``configs/ntk_dfl.py``,
``my_configs/sweep.py:smoke``); ``configs/`` at the repository root points here.
Text after the first ``:`` is the comma-separated variant string handed to
``get_config``.
"""

from __future__ import annotations

import pathlib

__all__ = ["CONFIG_DIR", "names", "resolve"]

CONFIG_DIR = pathlib.Path(__file__).resolve().parent
"""The folder holding the packaged config files (inside the installed package)."""


def names() -> list[str]:
  """The packaged configs, by name: ``['centralized', 'cp_ntk_fl', ..., 'spark']``."""
  return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def _is_name(file_part: str) -> bool:
  """A bare word (no folder, no ``.py``) names a packaged config; anything else is a path."""
  return (
    bool(file_part)
    and "/" not in file_part
    and "\\" not in file_part
    and not file_part.endswith(".py")
  )


def resolve(spec: str) -> str:
  """``'ntk_dfl:smoke'`` -> ``'<package>/configs/ntk_dfl.py:smoke'``; a path (``'configs/x.py:v'``) is returned as is.

  Raises:
    ValueError: ``spec`` names no packaged config (the message lists them).
  """
  file_part, sep, variant = spec.partition(":")
  if not _is_name(file_part):
    return spec
  path = CONFIG_DIR / f"{file_part}.py"
  if file_part not in names():
    raise ValueError(
      f"unknown config {file_part!r}; packaged configs: {', '.join(names())} "
      "(or give the path of a config file, e.g. path/to/config.py:variant)"
    )
  return f"{path}{sep}{variant}"
