"""Compression of transmitted tensors and communication accounting.

So far: uniform ``b``-bit quantisation of weights (what the NTK-DFL authors'
quantised baselines do before sending a model: 256 levels = 8 bits) and the
bit count of a payload. Both are generic -- any array, any pytree.

Quantisation is per tensor and min-max scaled: with ``lo = min(x)``,
``hi = max(x)`` and ``s = (hi - lo) / (2**b - 1)``, a value is sent as the
integer level ``round((x - lo) / s)`` in ``[0, 2**b - 1]`` plus the two float32
numbers ``lo`` and ``s``; the receiver reconstructs ``lo + level * s``.

* deterministic (nearest level): ``|x - q(x)| <= s / 2``;
* stochastic (round up with probability equal to the fractional part):
  unbiased, ``E[q(x)] = x``, and ``|x - q(x)| < s``.

Payload (:func:`payload_bits`): ``b`` bits per value plus 64 bits of side
information (``lo``, ``s``) per tensor; ``bits=32`` means raw float32 with no
side information. An optional bitmap (one bit per coordinate) accounts for a
sparse payload whose support the receiver does not know (DisPFL's masks).
"""
from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["quantize", "quantize_tree", "payload_bits", "tree_payload_bits", "FLOAT_BITS", "SIDE_BITS"]

FLOAT_BITS = 32
"""Bits of one uncompressed value (float32)."""

SIDE_BITS = 2 * FLOAT_BITS
"""Side information of one quantised tensor: its offset ``lo`` and step ``s`` as float32."""

_MAX_BITS = 16  # 2**16 levels already resolve float32 weights far below their spread


def _check_bits(bits: Any) -> int:
  if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 1 <= bits <= _MAX_BITS:
    raise ValueError(f"bits must be an int in [1, {_MAX_BITS}] (32 = no quantisation is handled by the caller), "
                     f"got {bits!r}")
  return int(bits)


def quantize(x, bits: int, *, key=None, stochastic: bool = False):
  """Uniform ``bits``-bit min-max quantisation of one tensor (returns the reconstruction).

  Args:
    x: float array of any shape.
    bits: levels ``2**bits`` (an int in ``[1, 16]``).
    key: PRNG key; required when ``stochastic``.
    stochastic: unbiased stochastic rounding instead of nearest-level rounding.

  Returns:
    ``lo + level * s`` with the dtype and shape of ``x`` (see the module
    docstring for the error bounds). A constant tensor is reproduced exactly.
  """
  bits = _check_bits(bits)
  if stochastic and key is None:
    raise ValueError("quantize(stochastic=True) needs a PRNG key")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize expects a float array, got dtype {x.dtype}")
  levels = 2 ** bits - 1
  lo, hi = jnp.min(x), jnp.max(x)
  step = (hi - lo) / levels
  # A constant tensor has step 0: divide by 1 instead (every level is then 0, reconstruction = lo).
  scaled = (x - lo) / jnp.where(step > 0, step, 1)
  if stochastic:
    level = jnp.floor(scaled + jax.random.uniform(key, x.shape, dtype=x.dtype))
  else:
    level = jnp.round(scaled)
  level = jnp.clip(level, 0, levels)  # float rounding at the top end must not create level 2**b
  return (lo + level * step).astype(x.dtype)


def quantize_tree(tree, bits: int, *, key=None, stochastic: bool = False):
  """:func:`quantize` applied to every leaf (one ``lo``/``s`` pair per leaf; independent keys)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = list(jax.random.split(key, len(leaves))) if stochastic and key is not None else [key] * len(leaves)
  return jax.tree_util.tree_unflatten(
      treedef, [quantize(leaf, bits, key=k, stochastic=stochastic) for leaf, k in zip(leaves, keys)])


def payload_bits(num_values, bits: int = FLOAT_BITS, *, num_tensors: int = 1, bitmap_size: int = 0):
  """Bits needed to send ``num_values`` values in ``num_tensors`` tensors.

  Args:
    num_values: values sent (an int, or an int array for per-client counts).
    bits: bits per value; ``32`` = raw float32 (no side information), otherwise
      a quantisation level count ``2**bits`` (adds :data:`SIDE_BITS` per tensor).
    num_tensors: number of separately quantised tensors.
    bitmap_size: coordinates covered by a 1-bit support mask (0 = dense payload).

  Returns:
    ``num_values * bits + side + bitmap_size`` (same type as ``num_values``).
  """
  if bits != FLOAT_BITS:
    _check_bits(bits)
  side = 0 if bits == FLOAT_BITS else SIDE_BITS * num_tensors
  return num_values * bits + side + bitmap_size


def tree_payload_bits(tree, bits: int = FLOAT_BITS) -> int:
  """:func:`payload_bits` of a dense pytree (every leaf one tensor); a Python int."""
  leaves = jax.tree_util.tree_leaves(tree)
  return int(payload_bits(sum(int(leaf.size) for leaf in leaves), bits, num_tensors=len(leaves)))
