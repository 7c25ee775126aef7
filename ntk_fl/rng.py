"""Every random stream of a run, derived from the one config seed.

A run draws from several independent streams (the data partition, the graph of
every round, client participation, ...). Each has a fixed id in :class:`Stream`
and is derived as ``numpy.random.SeedSequence([seed, id, *indices])`` (host-side
draws) or ``fold_in(fold_in(key(seed), id), index)`` (device-side keys).

Why a table: two streams must never share entropy. numpy's ``SeedSequence``
ignores trailing zeros, so ``[seed, 0] == [seed]`` and a per-round stream
``[seed, r]`` would replay the partition's stream at ``r = 0`` and any other
``[seed, k]`` stream at ``r = k``. Keeping every id here, distinct and
non-zero, and putting the stream id *before* the round index rules that out.

``Stream.PARTITION`` is the bare seed (``default_rng(seed)``), so
:func:`ntk_fl.data.partition` called with a seed draws the same partition as a
run with that config seed; no other stream may use the bare seed.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Stream", "numpy_rng", "jax_key", "masked_permutation"]


class Stream(enum.IntEnum):
  """Stream ids (distinct and, except the partition's bare seed, non-zero)."""

  PARTITION = 0  # data.partition: default_rng(seed)
  SUBSAMPLE = 1  # runner: optional training-set subsample (config.data.max_train)
  PARTICIPATION = 2  # server methods: clients sampled in round r
  SHARED_SET = 3  # DataShare's global set
  ROUND_KEYS = 4  # per-round device keys of every method (minibatches, subsampling, SAM noise)
  TOPOLOGY = 5  # the graph of round r
  SELECTION = 6  # final-averaging selection: validation/test split and random order
  SYNTHETIC_DATA = 7  # the 'synthetic' dataset's draw
  MASKS = 8  # DisPFL's initial sparse masks
  ENSEMBLE_SCHEDULE = (
    9  # Fed-ensemble: client strata (index 0) and each age's permutation matrix (1, age)
  )
  PROJECTION = 10  # SPARK's Jacobian random projections: index = 32-bit hash of (seed, layer name)
  INPUT_PROJECTION = (
    11  # CP-NTK-FL's shared input projection P (d1 -> d1'), fixed for the whole run
  )
  PRIVACY_ATTACK = 12  # experiments/privacy_attack.py: victim images (0), dummy inits (1), attacker's guess of P (2)
  TEST_SUBSAMPLE = 13  # runner: optional test-set subsample (config.data.max_test)
  VALIDATION_CLIENTS = 14  # NTK-FL: the clients held out to score τ (select='validation')
  STRAGGLERS = 15  # Fed-ensemble's straggler latency model: the selected clients' speeds in round r


def numpy_rng(seed: int, stream: Stream, *indices: int) -> np.random.Generator:
  """Host-side generator of ``stream`` (``indices``, e.g. the round, sub-divide it)."""
  if stream == Stream.PARTITION:
    if indices:
      raise ValueError(f"the partition stream is the bare seed and takes no indices, got {indices}")
    return np.random.default_rng(seed)
  return np.random.default_rng(np.random.SeedSequence([int(seed), int(stream), *map(int, indices)]))


def jax_key(seed: int, stream: Stream, *indices: int) -> jax.Array:
  """Device-side key of ``stream``: ``key(seed)`` folded with the stream id, then each index."""
  key = jax.random.fold_in(jax.random.key(seed), int(stream))
  for index in indices:
    key = jax.random.fold_in(key, index)
  return key


def masked_permutation(key: jax.Array, mask: jax.Array) -> jax.Array:
  """Indices along the last axis: the real entries (``mask`` True) in uniformly random order, then the padding.

  The one home of the random-subset trick: every entry draws a uniform priority, padding gets 2 (above any
  draw) and the priorities are sorted, so the first ``k`` indices are a uniform random ``k``-subset of the
  real entries whenever ``k <= mask.sum(-1)`` (local training's epoch order, NTK-DFL's and CP-NTK-FL's data
  sub-sampling). ``mask [..., n]`` bool; leading axes are independent rows of one draw.

  Returns:
    int32 ``[..., n]``.
  """
  priorities = jax.random.uniform(key, mask.shape)
  return jnp.argsort(jnp.where(mask, priorities, 2.0), axis=-1).astype(jnp.int32)
