"""The user's own flax module, named on the command line: ``config.model.module = 'package.module:factory'``.

``factory`` is called as ``factory(input_shape, num_classes)`` and must return a ``flax.linen.Module``
whose ``__call__(x)`` maps a batch ``x [B, *input_shape]`` to logits ``[B, num_classes]``. The inputs
are the dataset's images, not flattened: ``(28, 28, 1)`` for the MNIST family, ``(32, 32, 3)`` for
CIFAR-10 (a dense model flattens them itself, ``x.reshape(x.shape[0], -1)``). Both arguments are
passed so that one factory serves every dataset; a factory that needs neither may ignore them.

The spec's module part is a dotted module name importable from ``sys.path`` (``PYTHONPATH``), or a
path to a ``.py`` file (``./my_models.py:make``).

**Trusted code.** Naming a module imports it: its top level and the factory run with the user's
rights, as any Python import does. Name only code you would run yourself. A run directory's stored
``config.json`` is data and imports nothing on its own (:func:`ntk_fl.rundir.rebuild_config`).

The module is checked where the config is (:func:`ntk_fl.schema.validate_config`), before any data
loads: the spec's form, the import, the factory's presence, that it returns a flax module, and that
the module's logits on a probe batch of the dataset's input shape have shape ``[1, num_classes]``
(by ``jax.eval_shape``: nothing is computed).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from ntk_fl._src import method_modules

__all__ = ["load_factory", "build_module", "check_module", "imported"]


def _split(spec: str) -> tuple[str, str]:
  if not isinstance(spec, str) or spec.count(":") != 1:
    raise ValueError(
      f"config.model.module = {spec!r} must have the form 'package.module:factory' "
      "(or 'path/to/file.py:factory')"
    )
  module, attr = spec.split(":")
  if not module or not attr.isidentifier():
    raise ValueError(
      f"config.model.module = {spec!r} must have the form 'package.module:factory' with a "
      "module and a function name"
    )
  return module, attr


def imported(spec: str) -> bool:
  """Whether the module of ``spec`` was imported in this process already (so reading it runs no new code)."""
  return method_modules.module_imported(spec.split(":")[0])


def _import(module: str, spec: str):
  try:
    return method_modules.load_module(module)
  except (ImportError, FileNotFoundError) as e:
    raise ValueError(
      f"config.model.module = {spec!r}: module {module!r} could not be imported: {e}"
    ) from e


def load_factory(spec: str) -> Callable[..., Any]:
  """Imports ``spec``'s module (trusted code: see the module docstring) and returns its factory."""
  module, attr = _split(spec)
  factory = getattr(_import(module, spec), attr, None)
  if factory is None:
    raise ValueError(f"config.model.module = {spec!r}: module {module!r} has no attribute {attr!r}")
  if not callable(factory):
    raise ValueError(
      f"config.model.module = {spec!r}: {attr!r} is a {type(factory).__name__}, not a "
      "function returning a flax module"
    )
  return factory


def build_module(spec: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
  """``factory(input_shape, num_classes)`` of ``spec``, checked to be a ``flax.linen.Module``."""
  module = load_factory(spec)(tuple(input_shape), int(num_classes))
  if not isinstance(module, nn.Module):
    raise ValueError(
      f"config.model.module = {spec!r}: the factory returned a {type(module).__name__}, not a "
      "flax.linen.Module (it is called as factory(input_shape, num_classes))"
    )
  return module


def check_module(spec: str, input_shape: tuple[int, ...], num_classes: int) -> None:
  """Builds the module and checks its logits' shape on a probe batch ``[1, *input_shape]`` (shapes only)."""
  module = build_module(spec, input_shape, num_classes)
  probe = jnp.zeros((1, *input_shape), jnp.float32)
  try:
    variables = jax.eval_shape(module.init, jax.random.key(0), probe)
    out = jax.eval_shape(module.apply, variables, probe)
  except Exception as e:  # pylint: disable=broad-except -- any failure of user code, reported by name
    raise ValueError(
      f"config.model.module = {spec!r}: the module fails on a batch of shape "
      f"{(1, *input_shape)}: {type(e).__name__}: {e}"
    ) from e
  shape = getattr(out, "shape", None)
  if shape != (1, num_classes):
    raise ValueError(
      f"config.model.module = {spec!r}: the module must return logits [B, {num_classes}], got "
      f"{shape if shape is not None else type(out).__name__} for a batch of shape "
      f"{(1, *input_shape)}"
    )
