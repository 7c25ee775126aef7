"""Top-k sparsification and sparse payload accounting (quantisation is covered in test_baselines)."""

import math

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import communication, compression
from scripts import load_benchmark


def _brute_topk_mask(values, k):
  order = sorted(range(len(values)), key=lambda i: (-abs(values[i]), i))
  mask = np.zeros(len(values), bool)
  mask[order[:k]] = True
  return mask


@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.5, 1.0])
def test_topk_whole_array_keeps_the_largest_magnitudes(fraction):
  x = jax.random.normal(jax.random.key(0), (7, 9), jnp.float32)
  sparse, mask = compression.sparsify_topk(x, fraction)
  flat = np.asarray(x).ravel()
  k = compression.num_kept(flat.size, fraction)
  assert k == max(1, math.ceil(fraction * flat.size - 1e-9))
  np.testing.assert_array_equal(np.asarray(mask).ravel(), _brute_topk_mask(flat, k))
  np.testing.assert_array_equal(
    np.asarray(sparse).ravel(), np.where(_brute_topk_mask(flat, k), flat, 0)
  )


class SparsifyTest(chex.TestCase):
  """Top-k sparsification against a brute-force mask, called directly and under jit (chex.variants)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_topk_keeps_the_largest_magnitudes_with_and_without_jit(self):
    x = jax.random.normal(jax.random.key(3), (6, 11), jnp.float32)
    sparse, mask = self.variant(functools.partial(compression.sparsify_topk, keep_fraction=0.2))(x)
    flat = np.asarray(x).ravel()
    want_mask = _brute_topk_mask(flat, compression.num_kept(flat.size, 0.2)).reshape(x.shape)
    chex.assert_trees_all_equal((sparse, mask), (np.where(want_mask, np.asarray(x), 0), want_mask))
    chex.assert_trees_all_equal_shapes_and_dtypes((sparse, mask), (x, jnp.zeros(x.shape, bool)))


def test_topk_along_an_axis_selects_per_row():
  x = jax.random.normal(jax.random.key(1), (5, 4, 6), jnp.float32)
  sparse, mask = compression.sparsify_topk(x, 0.5, axis=1)  # 2 of 4 along axis 1
  xs = np.asarray(x)
  for i in range(5):
    for j in range(6):
      expected = _brute_topk_mask(xs[i, :, j], 2)
      np.testing.assert_array_equal(np.asarray(mask)[i, :, j], expected)
      np.testing.assert_array_equal(np.asarray(sparse)[i, :, j], np.where(expected, xs[i, :, j], 0))
  assert int(np.asarray(mask).sum()) == 5 * 6 * 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_topk_mask_breaks_heavy_ties_by_position(dtype):
  """Few distinct magnitudes (±, zeros, -0.0, a huge and a subnormal value): the bisection on bit patterns keeps
  exactly k per row, the largest first and the lowest index among equals, for every k."""
  rng = np.random.default_rng(0)
  values = rng.choice([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 3e4, 1e-7], size=(3, 23)).astype(np.float32)
  x = jnp.asarray(values, dtype)
  rounded = np.asarray(x.astype(jnp.float32))  # the values as the dtype holds them
  for k in (1, 5, 11, 22, 23):
    mask = np.asarray(compression.topk_mask(jnp.abs(x), k))
    for row in range(3):
      np.testing.assert_array_equal(
        mask[row], _brute_topk_mask(rounded[row], k), err_msg=f"k={k} row={row}"
      )
  with pytest.raises(ValueError, match="k must be in"):
    compression.topk_mask(jnp.abs(x), 24)


def test_top_k_by_key_takes_a_traced_k_and_skips_negative_keys():
  """Integer keys with heavy ties and excluded (negative) entries, k traced under jit: the k largest eligible
  keys, lowest index first among equals; k = 0 selects nothing, k above the eligible count selects them all."""
  rng = np.random.default_rng(3)
  keys = rng.choice([-1, -7, 0, 3, 3, 5, 9, 2**30], size=(4, 31)).astype(np.int32)
  select = jax.jit(compression.top_k_by_key)
  for k in (0, 1, 4, 9, 17, 31, 40):
    mask = np.asarray(select(keys, k))
    for row in range(4):
      eligible = [i for i in range(31) if keys[row, i] >= 0]
      chosen = sorted(eligible, key=lambda i: (-keys[row, i], i))[: max(k, 0)]
      expected = np.zeros(31, bool)
      expected[chosen] = True
      np.testing.assert_array_equal(mask[row], expected, err_msg=f"k={k} row={row}")
  with pytest.raises(ValueError, match="signed integer"):
    compression.top_k_by_key(jnp.ones(3), 1)


def test_topk_mask_of_16_bit_values_takes_a_k_beyond_the_16_bit_range():
  """bfloat16 magnitudes have int16 keys; k = 35,000 of 40,000 must not be cast to (and wrap around in) int16."""
  x = jax.random.normal(jax.random.key(5), (40_000,), jnp.bfloat16)
  k = 35_000
  mask = np.asarray(compression.topk_mask(jnp.abs(x), k))
  np.testing.assert_array_equal(mask, _brute_topk_mask(np.asarray(x.astype(jnp.float32)), k))


# The former selection, the threshold by a bisection over the key range (one counting pass per bit) and the
# ties by a running count over the whole row: one copy, in the benchmark that times it against the radix select.
_bisection_top_k_by_key = load_benchmark("topk_select").bisection_top_k_by_key


def _random_magnitudes(rng, kind, shape):
  if kind == "normal":
    return rng.standard_normal(shape)
  if kind == "few values":  # heavy ties, ±0, a subnormal, NaN and inf
    return rng.choice([0.0, -0.0, 1.0, -1.0, 2.5, 1e-40, np.nan, np.inf], size=shape)
  if kind == "rounded":
    return np.round(rng.standard_normal(shape) * 2)
  if kind == "mostly zero":  # fewer nonzeros than k: the threshold is 0 and the zeros tie
    return np.where(rng.random(shape) < 0.9, 0.0, rng.standard_cauchy(shape))
  return np.exp(rng.standard_normal(shape) * 30)  # 80 octaves: under- and overflow to 0 and inf


@pytest.mark.parametrize("kind", ["normal", "few values", "rounded", "mostly zero", "wide"])
def test_radix_select_keeps_the_same_entries_as_the_bisection(kind):
  """The radix select and its blocked tie-break against the former bisection and whole-row running count:
  identical masks for every k (below 0 to above the row), one k per row, with excluded (negative) keys,
  under jit and vmap, for 32- and 16-bit keys, at row lengths around the tie-break's block size and the
  histogram's step; and
  against a stable sort."""
  rng = np.random.default_rng(len(kind))
  new, old = jax.jit(compression.top_k_by_key), jax.jit(_bisection_top_k_by_key)
  new_rows = jax.jit(jax.vmap(compression.top_k_by_key))
  # 2·2**16 + 3: the histogram's steps of 2**16 entries, a loop over them and a remainder
  cases = [(jnp.float32, n) for n in (7, 1025, 70_001, 2 * 65_536 + 3)] + [
    (jnp.bfloat16, 1000),
    (jnp.float16, 4099),
  ]
  for dtype, n in cases:
    with np.errstate(over="ignore"):
      values = jnp.asarray(_random_magnitudes(rng, kind, (3, n)), dtype)
    keys = compression.magnitude_key(jnp.abs(values))
    keys = jnp.where(jnp.asarray(rng.random((3, n)) < 0.2), -1, keys).astype(keys.dtype)
    where = f"{jnp.dtype(dtype).name} n={n}"
    for k in sorted({-1, 0, 1, n // 3, n // 2, n - 1, n, n + 5}):
      k = jnp.int32(k)  # traced: one compilation per shape
      np.testing.assert_array_equal(new(keys, k), old(keys, k), err_msg=f"{where} k={k}")
    per_row = jnp.asarray(rng.integers(-2, n + 3, size=3), jnp.int32)
    mask = np.asarray(new(keys, per_row))
    np.testing.assert_array_equal(mask, old(keys, per_row), err_msg=f"{where} per row")
    np.testing.assert_array_equal(new_rows(keys, per_row), mask, err_msg=f"{where} vmap")
    if n <= 4099:  # a stable sort: the k largest eligible keys, lowest index first among equals
      host = np.asarray(keys).astype(np.int64)
      for row, k in enumerate(np.asarray(per_row)):
        order = [i for i in np.argsort(-host[row], kind="stable") if host[row, i] >= 0]
        expected = np.zeros(n, bool)
        expected[order[: max(int(k), 0)]] = True
        np.testing.assert_array_equal(mask[row], expected, err_msg=f"{where} sort row {row}")


def test_radix_select_of_64_bit_keys():
  """Keys of a 64-bit type take four histogram passes; the mask is still the k largest, lowest index first."""
  rng = np.random.default_rng(11)
  with jax.enable_x64(True):
    keys = jnp.asarray(
      rng.choice([-5, 0, 1, 2**40, 2**40 + 1, 2**62, 2**62 + 3], size=(2, 500)), jnp.int64
    )
    for k in (0, 1, 100, 400, 600):
      np.testing.assert_array_equal(
        compression.top_k_by_key(keys, k), _bisection_top_k_by_key(keys, k), err_msg=f"k={k}"
      )


def test_magnitude_key_orders_like_the_values():
  values = jnp.array([0.0, 1e-40, 1e-7, 0.5, 1.0, 3e38, jnp.inf], jnp.float32)  # incl. a subnormal
  keys = np.asarray(compression.magnitude_key(values))
  assert (np.diff(keys) > 0).all() and keys[0] == 0
  assert keys[-1] == int(compression.max_magnitude_key(jnp.float32))


def test_topk_is_jittable_and_validates():
  x = jnp.arange(10.0) - 4.5
  sparse, mask = jax.jit(lambda v: compression.sparsify_topk(v, 0.2))(x)
  np.testing.assert_array_equal(np.flatnonzero(np.asarray(mask)), [0, 9])
  for bad in (0.0, 1.5, -0.1, True):
    with pytest.raises(ValueError, match="keep_fraction"):
      compression.sparsify_topk(x, bad)
  with pytest.raises(ValueError, match="float"):
    compression.sparsify_topk(jnp.arange(4), 0.5)


def test_sparse_payload_counts_the_cheaper_support_encoding():
  size = 1024  # 10-bit indices
  # Few nonzeros: the index list (3 * 10 bits) beats the 1024-bit bitmap.
  assert compression.sparse_payload_bits(3, size) == 3 * 32 + 3 * 10
  # Many nonzeros: the bitmap wins.
  assert compression.sparse_payload_bits(500, size) == 500 * 32 + 1024
  # Quantised values add the per-tensor side information.
  assert compression.sparse_payload_bits(500, size, 6) == 500 * 6 + compression.SIDE_BITS + 1024
  per_client = compression.sparse_payload_bits(jnp.array([3.0, 500.0]), size)
  np.testing.assert_allclose(np.asarray(per_client), [3 * 32 + 30, 500 * 32 + 1024])
  with pytest.raises(ValueError, match="size"):
    compression.sparse_payload_bits(3, 0)


def test_jacobian_package_and_neighbourhood_round_bits_by_hand():
  d = 79_510  # MLP 784-100-10
  leaf_sizes = (78_400, 100, 1_000, 10)
  full = communication.jacobian_package_bits(200, 10, leaf_sizes)
  assert (
    full == 200 * 10 * d * 32 + 200 * 10 * 32 + 200 * 4
  )  # Jacobian, function values, 4-bit labels
  assert communication.jacobian_package_bits(0, 10, leaf_sizes) == 0
  assert int(communication.neighbourhood_round_bits(5, full, d)) == 5 * (2 * d * 32 + full)
  assert int(communication.neighbourhood_round_bits(5, full, d, averaging=False)) == 5 * (
    d * 32 + full
  )
  assert int(
    communication.neighbourhood_round_bits(5, full, d, averaging=False, broadcast=True)
  ) == 5 * (d * 32 + full)
  # SPARK's full stack: flattened sketch to 10,000 for the first layer, top-50 %, 6 bits, 40 samples (m = 5).
  sketched = (10_000, 100, 1_000, 10)
  stack = communication.jacobian_package_bits(40, 10, sketched, keep_fraction=0.5, bits=6)
  expected = 40 * 10 * 32 + 40 * 4
  for size in (400 * 10_000, 400 * 100, 400 * 1000, 400 * 10):  # n·C·projected size per tensor
    kept = math.ceil(0.5 * size)
    expected += kept * 6 + 64 + min(size, kept * math.ceil(math.log2(size)))
  assert stack == expected
  assert (
    int(communication.neighbourhood_round_bits(5, stack, d, broadcast=True)) == 5 * d * 32 + stack
  )
  assert int(communication.neighbourhood_round_bits(5, full, d, velocity=True)) == 5 * (
    3 * d * 32 + full
  )
  assert (
    int(communication.neighbourhood_round_bits(5, stack, d, broadcast=True, velocity=True))
    == 5 * 2 * d * 32 + stack
  )
  kappa = jnp.asarray([0.0, 2.0])  # an isolated client sends nothing
  np.testing.assert_array_equal(
    np.asarray(communication.neighbourhood_round_bits(kappa, 7.0, 3, broadcast=True)),
    [0.0, 2 * 3 * 32 + 7],
  )
