"""Compression of transmitted tensors and the bit count of a payload (the primitives).

Uniform ``b``-bit quantisation (what the NTK-DFL authors' quantised baselines
do before sending a model: 256 levels = 8 bits), magnitude top-k
sparsification (CP-NTK-FL's and SPARK's Jacobian sparsification) and the bit
count of a payload, dense or sparse. All generic -- any array, any pytree.

Quantisation is per tensor and min-max scaled: with ``lo = min(x)``,
``hi = max(x)`` and ``s = (hi - lo) / (2**b - 1)``, a value is sent as the
integer level ``round((x - lo) / s)`` in ``[0, 2**b - 1]`` plus the two float32
numbers ``lo`` and ``s``; the receiver reconstructs ``lo + level * s``.

* deterministic (nearest level): ``|x - q(x)| <= s / 2``;
* stochastic (round up with probability equal to the fractional part):
  unbiased, ``E[q(x)] = x``, and ``|x - q(x)| < s``.

Payload (:func:`payload_bits`): ``b`` bits per value plus 64 bits of side
information (``lo``, ``s``) per tensor; ``bits=32`` means raw float32 with no
side information. A sparse payload also carries its support: a bitmap (one bit
per coordinate, DisPFL's masks) or a list of ``ceil(log2 size)``-bit indices,
whichever is smaller (:func:`sparse_payload_bits`).

QSGD's stochastic quantiser (:func:`qsgd_quantize`, Alistarh et al. 2017; FedCOM's and QSGD's
uplink) scales by a norm instead: every bucket ``v`` of ``bucket_size`` consecutive entries is sent
as its norm (one float32) and, per entry, the sign and an integer level ``l`` in ``[0, s]`` of
``|v_i| / ||v|| * s``, rounded up with probability equal to the fractional part (unbiased) or to
the nearest level; a ``b``-bit code holds the signed level, so ``s = 2**(b - 1) - 1``.

What a particular protocol sends per round (the neighbourhood-NTK methods' packages and weights) is counted
in :mod:`ntk_fl.communication`, from these primitives.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
  "quantize",
  "quantize_tree",
  "qsgd_levels",
  "qsgd_quantize",
  "qsgd_quantize_tree",
  "topk_mask",
  "top_k_by_key",
  "magnitude_key",
  "max_magnitude_key",
  "sparsify_topk",
  "num_kept",
  "compress_packages",
  "payload_bits",
  "sparse_payload_bits",
  "tree_payload_bits",
  "FLOAT_BITS",
  "SIDE_BITS",
]

FLOAT_BITS = 32
"""Bits of one uncompressed value (float32)."""

SIDE_BITS = 2 * FLOAT_BITS
"""Side information of one quantised tensor: its offset ``lo`` and step ``s`` as float32."""

_MAX_BITS = 16  # 2**16 levels already resolve float32 weights far below their spread


def _check_bits(bits: Any) -> int:
  if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 1 <= bits <= _MAX_BITS:
    raise ValueError(
      f"bits must be an int in [1, {_MAX_BITS}] (32 = no quantisation is handled by the caller), "
      f"got {bits!r}"
    )
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
  levels = 2**bits - 1
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
  keys = (
    list(jax.random.split(key, len(leaves)))
    if stochastic and key is not None
    else [key] * len(leaves)
  )
  return jax.tree_util.tree_unflatten(
    treedef, [quantize(leaf, bits, key=k, stochastic=stochastic) for leaf, k in zip(leaves, keys)]
  )


def qsgd_levels(bits: int) -> int:
  """QSGD's level count ``s = 2**(bits - 1) - 1``: a ``bits``-bit code holds the signed level in ``[-s, s]``."""
  if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 2 <= bits <= _MAX_BITS:
    raise ValueError(
      f"QSGD bits must be an int in [2, {_MAX_BITS}] (a sign and at least one level bit), got {bits!r}"
    )
  return 2 ** (int(bits) - 1) - 1


def qsgd_quantize(
  x, bits: int, *, key=None, bucket_size: int = 0, norm: str = "l2", stochastic: bool = True
):
  """QSGD's quantiser ``Q_s`` (Alistarh et al. 2017, eq. (3.1)) of one tensor, bucket by bucket.

  The flattened tensor is cut into buckets of ``bucket_size`` entries (the last one zero-padded; 0 = one
  bucket). For a bucket ``v`` with scale ``a = ||v||_2`` (``norm='l2'``, the paper's) or ``max_i |v_i|``
  (``'max'``) and ``r_i = |v_i| / a * s`` (``s`` = :func:`qsgd_levels`), entry ``i`` becomes
  ``a * sign(v_i) * l_i / s`` with ``l_i = floor(r_i) + 1`` with probability ``r_i - floor(r_i)``, else
  ``floor(r_i)`` (``stochastic``: ``E[Q(v)] = v`` and, for ``'l2'``,
  ``E||Q(v) - v||^2 <= min(n / s^2, sqrt(n) / s) ||v||^2``, Lemma 3.1), or the nearest level.

  Args:
    x: float array of any shape.
    bits: code width per entry, sign included (:func:`qsgd_levels`).
    key: PRNG key; required when ``stochastic``. The draw is ``uniform(key, [num_buckets, bucket])``.
    bucket_size: entries per bucket (>= 0; 0 or ``>= x.size`` = the whole tensor).
    norm: ``'l2'`` or ``'max'``.
    stochastic: unbiased stochastic rounding (QSGD's); False rounds to the nearest level.

  Returns:
    The reconstruction, shaped and typed as ``x``. A zero bucket stays zero.
  """
  s = qsgd_levels(bits)
  if norm not in ("l2", "max"):
    raise ValueError(f"norm must be 'l2' or 'max', got {norm!r}")
  if stochastic and key is None:
    raise ValueError("qsgd_quantize(stochastic=True) needs a PRNG key")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"qsgd_quantize expects a float array, got dtype {x.dtype}")
  n = x.size
  bucket = n if bucket_size <= 0 or bucket_size >= n else int(bucket_size)
  num_buckets = -(-n // bucket)
  v = jnp.pad(x.reshape(-1), (0, num_buckets * bucket - n)).reshape(num_buckets, bucket)
  if norm == "l2":
    scale = jnp.sqrt(jnp.sum(jnp.square(v), axis=1, keepdims=True))
  else:
    scale = jnp.max(jnp.abs(v), axis=1, keepdims=True)
  # A zero bucket has scale 0: divide by 1 instead (every level is then 0).
  r = jnp.abs(v) / jnp.where(scale > 0, scale, 1) * s
  if stochastic:
    lower = jnp.floor(r)
    level = lower + (jax.random.uniform(key, v.shape, dtype=x.dtype) < r - lower)
  else:
    level = jnp.round(r)
  level = jnp.minimum(level, s)  # float rounding at |v_i| = ||v|| must not create level s + 1
  q = jnp.sign(v) * level * (scale / s)
  return q.reshape(-1)[:n].reshape(x.shape).astype(x.dtype)


def qsgd_quantize_tree(
  tree, bits: int, *, key=None, bucket_size: int = 0, norm: str = "l2", stochastic: bool = True
):
  """:func:`qsgd_quantize` of every leaf (buckets within a leaf; leaf ``j`` draws with ``split(key, L)[j]``)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = list(jax.random.split(key, len(leaves))) if stochastic else [None] * len(leaves)
  return jax.tree_util.tree_unflatten(
    treedef,
    [
      qsgd_quantize(leaf, bits, key=k, bucket_size=bucket_size, norm=norm, stochastic=stochastic)
      for leaf, k in zip(leaves, keys)
    ],
  )


def num_kept(size: int, keep_fraction: float) -> int:
  """Entries kept by :func:`sparsify_topk` out of ``size``: ``ceil(keep_fraction * size)``, at least 1."""
  if (
    isinstance(keep_fraction, bool)
    or not isinstance(keep_fraction, numbers.Real)
    or not 0 < keep_fraction <= 1
  ):
    raise ValueError(f"keep_fraction must be a real in (0, 1], got {keep_fraction!r}")
  if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
    raise ValueError(f"size must be an int >= 1, got {size!r}")
  return max(1, min(int(size), math.ceil(keep_fraction * size - 1e-9)))


_BIT_PATTERNS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}
_DIGIT_BITS = 16  # radix of the threshold search: 2**16 histogram bins per pass
_TIE_BLOCK = 1024  # entries per block of the tie-break's blocked running count
_HISTOGRAM_STEP = 1 << 16  # entries per row per scatter of the radix select's histogram pass


def top_k_by_key(keys, k):
  """Bool mask of the ``k`` largest ``keys`` along the last axis; ties go to the lower index; negative keys never.

  The ``k``-th largest key of every row (the threshold) is found by a radix
  select (:func:`_kth_largest_key`): one histogram pass per 16-bit digit of the
  key, two for int32, instead of a sort or a 31-pass bisection, so ``k`` may be
  traced (DisPFL's annealed mask-update count is a function of the round). Keys
  above the threshold are kept; of those equal to it, the first ``k - above`` by
  index (:func:`_tie_cutoff`).

  Args:
    keys: signed integer array ``[..., n]``. Entries ``< 0`` are excluded;
      the others must be below the dtype's maximum.
    k: int, static or traced. ``k <= 0`` selects nothing; a ``k`` above a
      row's count of non-negative keys selects all of them.

  Returns:
    Bool array like ``keys``.
  """
  keys = jnp.asarray(keys)
  if not jnp.issubdtype(keys.dtype, jnp.signedinteger):
    raise ValueError(f"top_k_by_key expects signed integer keys, got dtype {keys.dtype}")
  batch, n = keys.shape[:-1], keys.shape[-1]
  rows = keys.reshape(-1, n)
  # not cast to the keys' type: a 16-bit key type cannot hold every k
  k = jnp.broadcast_to(jnp.asarray(k), batch).reshape(-1).astype(jnp.int32)
  threshold, room = _kth_largest_key(rows, k)
  above = rows > threshold[:, None]
  ties = rows == threshold[:, None]
  kept = above | (ties & (jnp.arange(n) < _tie_cutoff(ties, room)[:, None]))
  return kept.reshape(keys.shape)


def _kth_largest_key(rows, k):
  """Per row of ``rows [R, n]`` the ``k``-th largest non-negative key and the room left at it, by radix select.

  From the top digit down: a histogram of the digit over the entries whose
  higher digits equal the prefix found so far; its suffix sums count the keys
  at or above each digit value, and the digit is the largest value whose count
  still reaches the ``k`` left. Exactly the threshold a bisection on the keys
  finds (the largest ``t`` with ``count(keys >= t) >= k``), including the rows
  it settles by convention: ``k <= 0`` gives the dtype's maximum minus one,
  ``k`` above the count of non-negative keys gives 0.

  Returns:
    ``(threshold, room)``: ``threshold`` int ``[R]`` of the keys' dtype; ``room`` int32 ``[R]``, ``k`` minus
    the count of keys above the threshold (the ties to keep; any count ``>=`` the ties' where every tie
    is kept).
  """
  dtype = rows.dtype
  value_bits = 8 * dtype.itemsize - 1  # non-negative keys
  top = jnp.iinfo(dtype).max
  widths = [value_bits % _DIGIT_BITS or _DIGIT_BITS] + [_DIGIT_BITS] * (
    (value_bits - 1) // _DIGIT_BITS
  )
  prefix = jnp.zeros(rows.shape[:1], dtype)
  remaining = k
  shift = value_bits
  nonnegative = None
  for width in widths:
    shift -= width
    bins = 1 << width
    # Below the top digit only the keys whose higher digits equal the prefix found so far count.
    histogram = _digit_histogram(
      rows, shift, width, None if shift + width == value_bits else prefix
    )
    at_or_above = jnp.cumsum(histogram[:, ::-1], axis=-1)[:, ::-1]  # keys with digit >= b
    if nonnegative is None:
      nonnegative = at_or_above[:, 0]
    chosen = jnp.sum(at_or_above >= remaining[:, None], axis=-1, dtype=jnp.int32) - 1
    chosen = jnp.clip(chosen, 0, bins - 1)  # only a settled-by-convention row leaves [0, bins)
    strictly_above = jnp.take_along_axis(
      jnp.pad(at_or_above, ((0, 0), (0, 1))), chosen[:, None] + 1, axis=-1
    )[:, 0]
    remaining = remaining - strictly_above
    prefix = (prefix << width) | chosen.astype(dtype)
  # The bisection never returns the maximum (it is its exclusive upper end).
  threshold = jnp.minimum(prefix, top - 1)
  threshold = jnp.where(k <= 0, top - 1, jnp.where(nonnegative < k, 0, threshold)).astype(dtype)
  # Settled rows: no key lies above the maximum minus one; with too few keys every tie (zero) is kept.
  return threshold, jnp.where((k <= 0) | (nonnegative < k), k, remaining)


def _digit_histogram(rows, shift: int, width: int, prefix):
  """``[R, 2**width]`` int32 counts of the digit ``(key >> shift) & (2**width - 1)`` of every row's keys.

  Counts the keys ``>= 0`` of each row of ``rows [R, n]`` and, when ``prefix`` (``[R]``, the keys' dtype) is
  given, only those whose higher bits ``key >> (shift + width)`` equal it. The row is scanned in steps of
  :data:`_HISTOGRAM_STEP` entries, each one scatter-add of its bin indices into one flat histogram of all
  rows: a step's digits and indices stay in cache instead of row-sized index arrays in memory (the
  counts are integers, so any order of the additions gives the same histogram).
  """
  num_rows, n = rows.shape
  bins = 1 << width
  if num_rows > 1 and num_rows * bins >= jnp.iinfo(jnp.int32).max:
    # The flat indices would overflow int32: one row at a time.
    one_row = lambda row, p: _digit_histogram(
      row[None], shift, width, None if prefix is None else p[None]
    )[0]
    return jax.vmap(one_row)(rows, jnp.zeros(num_rows, rows.dtype) if prefix is None else prefix)
  offsets = (jnp.arange(num_rows, dtype=jnp.int32) * bins)[:, None]

  def add(histogram, block):
    # block [R, b]; entries outside the prefix go to an out-of-range bin, which is dropped.
    match = block >= 0
    if prefix is not None:
      match = match & ((block >> (shift + width)) == prefix[:, None])
    digit = ((block >> shift) & (bins - 1)).astype(jnp.int32)
    index = jnp.where(match, digit + offsets, num_rows * bins)
    return histogram.at[index.reshape(-1)].add(1, mode="drop")

  histogram = jnp.zeros(num_rows * bins, jnp.int32)
  step = min(n, _HISTOGRAM_STEP)
  steps = n // step
  if steps > 1:
    histogram = jax.lax.fori_loop(
      0,
      steps,
      lambda j, h: add(h, jax.lax.dynamic_slice_in_dim(rows, j * step, step, axis=1)),
      histogram,
    )
  else:
    histogram = add(histogram, rows[:, :step])
  if n % step:
    histogram = add(histogram, rows[:, steps * step :])
  return histogram.reshape(num_rows, bins)


def _tie_cutoff(ties, room):
  """Per row of ``ties [R, n]``: the index below which the first ``room`` True entries lie (``n`` if all fit).

  A running count over blocks of :data:`_TIE_BLOCK` entries finds the block
  that holds the ``room``-th True entry; a running count inside that block
  alone finds its position. Equal to taking ``cumsum(ties) <= room`` but
  without a running count over the whole row.
  """
  num_rows, n = ties.shape
  # The largest block size up to _TIE_BLOCK that divides the row (no padded copy), unless it is small.
  block = max((b for b in range(1, min(_TIE_BLOCK, n) + 1) if n % b == 0), default=1)
  block = block if block >= min(n, _TIE_BLOCK // 4) else min(_TIE_BLOCK, n)
  num_blocks = -(-n // block)
  blocks = jnp.pad(ties, ((0, 0), (0, num_blocks * block - n))).reshape(num_rows, num_blocks, block)
  per_block = jnp.sum(blocks, axis=-1, dtype=jnp.int32)
  through = jnp.cumsum(per_block, axis=-1)  # ties up to each block's end
  where = jnp.sum(through < room[:, None], axis=-1, dtype=jnp.int32)  # first block reaching room
  inside = jnp.minimum(where, num_blocks - 1)
  before = jnp.where(
    inside > 0, jnp.take_along_axis(through, jnp.maximum(inside - 1, 0)[:, None], axis=-1)[:, 0], 0
  )
  running = before[:, None] + jnp.cumsum(
    jnp.take_along_axis(blocks, inside[:, None, None], axis=1)[:, 0], axis=-1, dtype=jnp.int32
  )
  length = jnp.sum(running <= room[:, None], axis=-1, dtype=jnp.int32)
  return jnp.where(where >= num_blocks, n, inside * block + length)


def magnitude_key(magnitude):
  """Signed-integer sort key of non-negative floats: the bit pattern, which is monotone in the value.

  ``magnitude`` must be ``>= 0`` and not NaN: pass ``jnp.abs(x)`` (``-0.0`` would map to a negative key). The
  keys lie in ``[0, max_magnitude_key(dtype)]``, so that bound minus a key reverses the order.
  """
  magnitude = jnp.asarray(magnitude)
  return jax.lax.bitcast_convert_type(magnitude, _BIT_PATTERNS[magnitude.dtype.itemsize])


def max_magnitude_key(dtype):
  """The key :func:`magnitude_key` gives ``+inf`` of float ``dtype`` (the largest a magnitude can have)."""
  return magnitude_key(jnp.array(jnp.inf, dtype))


def topk_mask(magnitude, k: int):
  """Bool mask of the ``k`` largest entries along the last axis; ties go to the lower index (as ``lax.top_k``).

  A non-negative float's bit pattern, read as a signed integer of the same
  width, is monotone in its value, so the ``k``-th largest value of every row is
  found by a radix select on the bit patterns (:func:`top_k_by_key`) instead of a
  sort: ``lax.top_k`` sorts on XLA's CPU backend (18.9 s for six of SPARK's
  4-million-entry packages at ``k = size/2``, against 1.25 s for the bisection
  that preceded the radix select, itself 3.8x slower; benchmarks/RESULTS.md), with
  identical masks.

  Args:
    magnitude: non-negative float array ``[..., n]`` (e.g. ``|x|``); no NaN.
    k: static ``1 <= k <= n``.
  """
  magnitude = jnp.asarray(magnitude)
  n = magnitude.shape[-1]
  if not 1 <= k <= n:
    raise ValueError(f"k must be in [1, {n}] (the last axis), got {k}")
  return top_k_by_key(magnitude_key(magnitude), k)


def sparsify_topk(x, keep_fraction: float, *, axis: int | None = None):
  """Keeps the ``num_kept`` largest-magnitude entries of ``x`` (the rest become 0).

  Args:
    x: float array.
    keep_fraction: fraction in ``(0, 1]`` of the entries to keep (``1`` = dense).
    axis: ``None`` selects over the whole array; an int selects independently
      along that axis for every index of the others (e.g. per sample row of a
      Jacobian ``[N, d]`` with ``axis=-1``).

  Returns:
    ``(sparse, mask)``: ``sparse`` has the shape and dtype of ``x`` with zeros
    outside the kept support; ``mask`` is the bool support. Ties at the
    threshold are broken by position (lower index first, as ``lax.top_k``),
    so exactly ``num_kept`` entries are kept per selection (:func:`topk_mask`).
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"sparsify_topk expects a float array, got dtype {x.dtype}")
  if axis is None:
    flat = x.reshape(-1)
    mask = topk_mask(jnp.abs(flat), num_kept(flat.size, keep_fraction)).reshape(x.shape)
  else:
    moved = jnp.moveaxis(x, axis, -1)
    mask = jnp.moveaxis(
      topk_mask(jnp.abs(moved), num_kept(moved.shape[-1], keep_fraction)), -1, axis
    )
  return jnp.where(mask, x, jnp.zeros_like(x)), mask


def compress_packages(
  leaves,
  mask,
  num_senders: int,
  keep_fraction: float,
  bits: int,
  *,
  sent=None,
):
  """Each sender's package of Jacobian rows, per tensor: zero padding rows, top-k magnitudes, ``bits``-bit values.

  The neighbourhood-NTK methods (NTK-DFL App. E.3, SPARK) stack the rows their
  neighbours send, sender after sender. A package is one sender's rows
  ``[n, C, ...]`` of one Jacobian tensor: it keeps the :func:`num_kept`
  largest magnitudes of its *real* rows' entries (the count the receiver is
  charged for, :func:`ntk_fl.communication.jacobian_package_bits`; ties to the
  lower index), one min-max quantiser covers the package tensor
  (:func:`quantize`), and entries outside the support stay exactly zero (the
  support is sent separately).

  Args:
    leaves: Jacobian tensors ``[num_senders * n, C, ...]`` (sender-major rows).
    mask: bool ``[num_senders * n]``, True for real samples.
    num_senders: packages per tensor.
    keep_fraction: top-k fraction in ``(0, 1]`` (1 = dense).
    bits: bits per value (:data:`FLOAT_BITS` = no quantisation).
    sent: optional bool ``[num_senders]``; packages marked False are not
      transmitted (a client's own rows) and are kept exact, padding zeroed.

  Returns:
    A tuple of tensors shaped like ``leaves``.
  """
  mask = jnp.asarray(mask, bool)
  real_rows = mask.reshape(num_senders, -1).sum(axis=1)

  def quantize_package(package, kept):
    quantized = quantize(package, bits)
    return quantized if kept is None else jnp.where(kept, quantized, 0)

  out = []
  for leaf in leaves:
    leaf = jnp.where(mask.reshape((-1,) + (1,) * (leaf.ndim - 1)), leaf, 0)
    rows = leaf.reshape((num_senders, -1) + leaf.shape[1:])
    row_size = math.prod(rows.shape[2:])
    # k of a package with r real rows, exact in integers (a float32 product would round above 2**24 entries).
    table = jnp.asarray(
      [0]
      + [
        num_kept(r * row_size, keep_fraction) if keep_fraction < 1 else 0
        for r in range(1, rows.shape[1] + 1)
      ],
      jnp.int32,
    )
    packed, kept = rows, None
    if keep_fraction < 1:  # every package's selection in one batch, each with its own k
      flat = rows.reshape(num_senders, -1)
      kept = top_k_by_key(magnitude_key(jnp.abs(flat)), table[real_rows]).reshape(rows.shape)
      packed = jnp.where(kept, rows, 0)
    if bits != FLOAT_BITS:
      packed = jax.vmap(quantize_package)(packed, kept)
    if sent is not None:
      packed = jnp.where(
        jnp.asarray(sent, bool).reshape((-1,) + (1,) * (rows.ndim - 1)), packed, rows
      )
    out.append(packed.reshape(leaf.shape))
  return tuple(out)


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


def sparse_payload_bits(num_values, size: int, bits: int = FLOAT_BITS):
  """Bits to send ``num_values`` nonzeros of one ``size``-entry tensor, support included.

  The support costs ``min(size, num_values * ceil(log2 size))`` bits: a bitmap or
  an index list, whichever the sender picks as smaller. Values (and the
  quantisation side information) as in :func:`payload_bits`. ``num_values`` may
  be an int or an int/float array (e.g. per client); sum over tensors yourself.
  """
  if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
    raise ValueError(f"size must be an int >= 1, got {size!r}")
  index_bits = max(1, math.ceil(math.log2(size)))
  if isinstance(num_values, numbers.Integral):
    support = min(size, num_values * index_bits)
  else:
    support = jnp.minimum(size, jnp.asarray(num_values) * index_bits)
  return payload_bits(num_values, bits) + support


def tree_payload_bits(tree, bits: int = FLOAT_BITS) -> int:
  """:func:`payload_bits` of a dense pytree (every leaf one tensor); a Python int."""
  leaves = jax.tree_util.tree_leaves(tree)
  return int(payload_bits(sum(int(leaf.size) for leaf in leaves), bits, num_tensors=len(leaves)))
