"""Federated methods, each a factory ``make_<method>(config, model, federation) -> Algorithm``.

:func:`get_algorithm` resolves a config's ``method`` name lazily, so importing
``ntk_fl.algorithms`` does not import every method; :func:`register` adds a
factory (e.g. a user's own method or a test double).
"""
from __future__ import annotations

import importlib
from typing import Callable

from ntk_fl.algorithms.base import Algorithm

__all__ = ["Algorithm", "get_algorithm", "register", "available"]

# name -> "module:function" (imported on first use) or a registered callable.
_REGISTRY: dict[str, str | Callable] = {
    "ntk_dfl": "ntk_fl.algorithms.ntk_dfl:make_ntk_dfl",
}


def register(name: str, factory: Callable) -> None:
  """Registers ``factory(config, model, federation) -> Algorithm`` under ``name``."""
  _REGISTRY[name] = factory


def available() -> list[str]:
  return sorted(_REGISTRY)


def get_algorithm(name: str) -> Callable:
  """Returns the factory registered as ``name``; a clear error lists the choices."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown method {name!r}; available methods: {', '.join(available())}")
  entry = _REGISTRY[name]
  if isinstance(entry, str):
    module_name, fn_name = entry.split(":")
    entry = getattr(importlib.import_module(module_name), fn_name)
    _REGISTRY[name] = entry
  return entry
