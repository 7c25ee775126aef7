"""Partitions, the Federation (index lists into one copy of the samples) and the label-distribution plot."""

from __future__ import annotations

import gzip
import os

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ntk_fl.data.federation import Federation, block_layout, federation_from_padded, make_federation
from ntk_fl.data.partition import PARTITIONS, partition
from ntk_fl.data.plots import class_counts, plot_label_distribution

FMNIST_LABELS = "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz"
DISJOINT = ("iid", "dirichlet", "shards", "by_writer")
GENERATED = tuple(
  m for m in PARTITIONS if m != "index_map"
)  # index_map reads a file: tests/test_index_map.py
SEEDED = tuple(m for m in GENERATED if m != "contiguous")
few = settings(max_examples=25, deadline=None)


def _labels(n, num_classes, seed):
  """Random labels in which every class occurs (so C = num_classes)."""
  rng = np.random.default_rng(seed)
  return rng.permutation(
    np.concatenate([np.arange(num_classes), rng.integers(num_classes, size=n - num_classes)])
  )


def _balanced(per_class, num_classes, seed=0):
  return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def _writers(n, num_writers, seed):
  rng = np.random.default_rng(seed)
  return (
    rng.permutation(
      np.concatenate([np.arange(num_writers), rng.integers(num_writers, size=n - num_writers)])
    )
    * 7
    + 3
  )


def _kwargs(method, n, seed, num_clients):
  """Arguments that make every method valid on ``_labels(n, 4, seed)`` (12 writers)."""
  kwargs = dict(alpha=0.3, classes_per_client=2 if num_clients >= 2 else 4)
  if method == "dirichlet_fixed_size":
    kwargs["samples_per_client"] = min(n // num_clients, n // 4)
  if method == "by_writer":
    kwargs["writers"] = _writers(n, 12, seed)
  return kwargs


def _max_class_fraction(labels, clients):
  counts = class_counts(labels, clients, int(labels.max()) + 1)
  return (counts.max(axis=1) / counts.sum(axis=1)).mean()


def _check_disjoint_cover(clients, num_samples):
  used = np.concatenate(clients)
  assert np.unique(used).size == used.size, "a sample was given to two clients"
  np.testing.assert_array_equal(np.sort(used), np.arange(num_samples))


# --- properties shared by every method --------------------------------------------------------


@pytest.mark.parametrize("method", GENERATED)
@few
@given(n=st.integers(40, 300), num_clients=st.integers(1, 10), seed=st.integers(0, 2**31))
def test_output_format(method, n, num_clients, seed):
  labels = _labels(n, 4, seed)
  clients = partition(
    labels, method, num_clients, seed=seed, **_kwargs(method, n, seed, num_clients)
  )
  assert len(clients) == num_clients
  for idx in clients:
    assert idx.dtype == np.int64 and idx.ndim == 1 and idx.size > 0
    assert np.all(np.diff(idx) > 0), "sorted ascending, no duplicates within a client"
    assert idx.min() >= 0 and idx.max() < n


@pytest.mark.parametrize("method", SEEDED)
def test_reproducible_and_seed_dependent(method):
  n = 400
  labels = _labels(n, 4, 0)
  kwargs = _kwargs(method, n, 0, 8)
  run = lambda seed: partition(labels, method, 8, seed=seed, **kwargs)
  first, again, other = run(1), run(1), run(2)
  assert all(np.array_equal(a, b) for a, b in zip(first, again))
  assert not all(np.array_equal(a, b) for a, b in zip(first, other))


@pytest.mark.parametrize("method", DISJOINT)
@few
@given(n=st.integers(40, 300), num_clients=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_disjoint_methods_use_every_sample_once(method, n, num_clients, seed):
  labels = _labels(n, 4, seed)
  kwargs = _kwargs(method, n, seed, num_clients)
  clients = partition(labels, method, num_clients, seed=seed, **kwargs)
  if method == "by_writer":  # a subset of writers: exactly the chosen writers' samples, once each
    used = np.concatenate(clients)
    assert np.unique(used).size == used.size
    chosen = np.unique(kwargs["writers"][used])
    assert chosen.size == num_clients
    np.testing.assert_array_equal(np.sort(used), np.flatnonzero(np.isin(kwargs["writers"], chosen)))
  else:
    _check_disjoint_cover(clients, n)


# --- iid --------------------------------------------------------------------------------------


@few
@given(n=st.integers(1, 500), num_clients=st.integers(1, 50), seed=st.integers(0, 2**31))
def test_iid_near_equal_parts(n, num_clients, seed):
  num_clients = min(num_clients, n)
  clients = partition(np.zeros(n, np.int32), "iid", num_clients, seed=seed)
  sizes = [c.size for c in clients]
  assert max(sizes) - min(sizes) <= 1
  _check_disjoint_cover(clients, n)


@few
@given(
  per=st.integers(1, 20),
  num_clients=st.integers(1, 20),
  spare=st.integers(0, 30),
  seed=st.integers(0, 2**31),
)
def test_iid_exact_samples_per_client(per, num_clients, spare, seed):
  n = per * num_clients + spare
  clients = partition(np.zeros(n, np.int32), "iid", num_clients, seed=seed, samples_per_client=per)
  assert [c.size for c in clients] == [per] * num_clients
  used = np.concatenate(clients)
  assert np.unique(used).size == used.size


# --- dirichlet (disjoint) ---------------------------------------------------------------------


@few
@given(
  n=st.integers(50, 400),
  num_clients=st.integers(2, 50),
  alpha=st.sampled_from([1e-3, 0.01, 0.1]),
  seed=st.integers(0, 2**31),
)
def test_dirichlet_small_alpha_many_clients_never_empty(n, num_clients, alpha, seed):
  # Tiny alpha with many clients leaves most clients empty on a plain draw: the bounded
  # redraw-then-repair must still hand everyone a sample and use every sample once.
  num_clients = min(num_clients, n)
  labels = _labels(n, 5, seed)
  clients = partition(labels, "dirichlet", num_clients, seed=seed, alpha=alpha)
  assert min(c.size for c in clients) >= 1
  _check_disjoint_cover(clients, n)


def test_dirichlet_alpha_controls_label_skew():
  labels = _balanced(500, 10)
  skewed = _max_class_fraction(labels, partition(labels, "dirichlet", 20, seed=0, alpha=0.1))
  uniform = _max_class_fraction(labels, partition(labels, "dirichlet", 20, seed=0, alpha=1000.0))
  # alpha = 1000: every client's share of each class is ~1/20, so its label mix is ~uniform.
  assert uniform < 0.1 + 0.03
  assert skewed > 0.5


def test_dirichlet_class_shares_have_the_dirichlet_variance():
  """Each class's split over ``M`` clients is one ``Dir(alpha 1_M)`` draw: share ``p`` ~ Beta(alpha, (M-1) alpha).

  Independent check: ``Var p = (M - 1) / (M^2 (M alpha + 1))`` (the Dirichlet's closed form). 400 classes
  of 2,000 samples (rounding moves a share by <= 1/2000) give 8,000 shares; the estimate of the variance
  lies within 12% of the formula (observed: within 3% for each alpha below), and a generator drawing with
  2 alpha (variance x0.52 at M alpha = 10) or alpha / 2 (x1.83) is far outside.
  """
  from ntk_fl.data.partition import _dirichlet_owners  # pylint: disable=import-outside-toplevel

  num_classes, per_class, m = 400, 2000, 20
  labels = np.repeat(np.arange(num_classes), per_class)
  for alpha in (0.1, 0.5, 2.0):
    owner = _dirichlet_owners(labels, m, alpha, np.random.default_rng(7))
    shares = np.zeros((num_classes, m))
    np.add.at(shares, (labels, owner), 1.0 / per_class)
    np.testing.assert_allclose(shares.sum(axis=1), 1.0)
    expected = (m - 1) / (m**2 * (m * alpha + 1))
    assert abs(shares.var() / expected - 1) < 0.12, (alpha, shares.var(), expected)


def test_an_empty_client_gets_the_last_majority_sample_of_the_largest_client():
  """The refill rule, worked by hand: donor = the largest client (the first of equals), the sample moved =
  its last sample of its most frequent class (the smallest label among equals); one move per empty client."""
  from ntk_fl.data.partition import _fill_empty_clients  # pylint: disable=import-outside-toplevel

  labels = np.array([0, 0, 1, 1, 1, 2, 0, 1])
  owner = np.array([0, 0, 0, 0, 0, 1, 1, 3])  # sizes 5, 2, 0, 1, 0: clients 2 and 4 are empty
  # Client 2: donor 0 (5 samples, labels 0 0 1 1 1: class 1) gives its last class-1 sample, index 4.
  # Client 4: donor 0 again (4 samples, labels 0 0 1 1: a tie, class 0) gives its last class-0 sample, index 1.
  np.testing.assert_array_equal(_fill_empty_clients(owner, labels, 5), [0, 4, 0, 0, 2, 1, 1, 3])
  # Donor ties go to the lower client id; the input is not changed.
  labels = np.array([2, 2, 1, 0, 0, 1])
  owner = np.array([1, 1, 1, 0, 0, 0])  # both hold 3: client 0 gives its last class-0 sample, 4
  np.testing.assert_array_equal(_fill_empty_clients(owner, labels, 3), [1, 1, 1, 0, 2, 0])
  np.testing.assert_array_equal(owner, [1, 1, 1, 0, 0, 0])


# --- dirichlet_fixed_size (the NTK papers' generator) -----------------------------------------


@few
@given(
  per_class=st.integers(20, 60),
  num_classes=st.integers(2, 6),
  num_clients=st.integers(1, 30),
  alpha=st.sampled_from([0.05, 0.5, 5.0]),
  seed=st.integers(0, 2**31),
)
def test_fixed_size_sizes_and_class_pure_pools(per_class, num_classes, num_clients, alpha, seed):
  labels = _balanced(per_class, num_classes, seed)
  n = labels.size
  per = min(n // num_clients, per_class)
  clients = partition(
    labels, "dirichlet_fixed_size", num_clients, seed=seed, alpha=alpha, samples_per_client=per
  )
  for idx in clients:
    # sum(floor(s q)) lies in (s - C, s]; at least one sample even when s < C.
    assert max(1, per - num_classes + 1) <= idx.size <= per
    # Balanced classes -> class-pure pools: no class exceeds the client's target size.
    assert np.bincount(labels[idx], minlength=num_classes).max() <= per


def test_fixed_size_default_size_and_overlap():
  labels = _balanced(100, 4)  # N = 400, C = 4
  clients = partition(labels, "dirichlet_fixed_size", 10, seed=3, alpha=0.5)
  sizes = np.array([c.size for c in clients])
  assert sizes.max() <= 400 // 10 and sizes.min() >= 40 - 4 + 1
  used = np.concatenate(clients)
  assert np.unique(used).size < used.size, "the authors' generator reuses samples across clients"


def test_fixed_size_unbalanced_pools_follow_label_sorted_order():
  # N = 103, C = 4: pools are the first 4 * floor(103 / 4) = 100 label-sorted indices, so the last
  # three sorted indices can never be drawn, however many clients draw.
  rng = np.random.default_rng(0)
  labels = rng.permutation(np.repeat(np.arange(4), [40, 30, 20, 13]))
  clients = partition(labels, "dirichlet_fixed_size", 60, seed=0, alpha=0.5, samples_per_client=25)
  used = np.unique(np.concatenate(clients))
  never = np.argsort(labels, kind="stable")[100:]
  assert not np.isin(never, used).any()
  assert np.isin(np.argsort(labels, kind="stable")[:100], used).mean() > 0.9


def test_fixed_size_label_proportions_follow_dirichlet():
  # Client label mixes are floor(s q) / sum with q ~ Dir(alpha 1_C): the mean largest class share
  # must match E[max q], estimated independently by direct Dirichlet draws.
  num_classes, per, num_clients = 10, 200, 400
  labels = _balanced(per, num_classes)
  measured = {}
  for alpha in (0.1, 1000.0):
    clients = partition(
      labels, "dirichlet_fixed_size", num_clients, seed=11, alpha=alpha, samples_per_client=per
    )
    measured[alpha] = _max_class_fraction(labels, clients)
    q = np.random.default_rng(123).dirichlet(np.full(num_classes, alpha), size=20_000)
    expected = q.max(axis=1).mean()
    spread = q.max(axis=1).std() / np.sqrt(num_clients)
    # 5 standard errors, plus floor truncation's bias (at most C / s of a share).
    assert abs(measured[alpha] - expected) < 5 * spread + num_classes / per
  # The two regimes are far apart: near-uniform vs one dominant class.
  assert measured[1000.0] < 0.11 and measured[0.1] > 0.6


def test_fixed_size_matches_shipped_fmnist_statistics():
  """Fashion-MNIST, 300 clients, alpha = 0.1: the authors' shipped files have client sizes
  194 / 197.4 / 199 (min / mean / max), 59,218 assignments and 37,882 unique indices."""
  if not os.path.exists(FMNIST_LABELS):
    pytest.fail(f"{FMNIST_LABELS} missing (Debian package dataset-fashion-mnist)")
  with gzip.open(FMNIST_LABELS) as f:
    labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
  assert labels.size == 60_000
  clients = partition(labels, "dirichlet_fixed_size", 300, seed=0, alpha=0.1)
  sizes = np.array([c.size for c in clients])
  used = np.concatenate(clients)
  assert 193 <= sizes.min() and sizes.max() <= 200
  assert abs(sizes.mean() - 197.4) < 0.6
  assert abs(used.size - 59_218) < 200
  assert abs(np.unique(used).size - 37_882) < 0.015 * 37_882


# --- shards -----------------------------------------------------------------------------------


@few
@given(num_classes=st.integers(2, 8), num_clients=st.integers(1, 30), data=st.data())
def test_shards_exactly_k_classes(num_classes, num_clients, data):
  k = data.draw(st.integers(1, num_classes))
  seed = data.draw(st.integers(0, 2**31))
  if num_clients * k < num_classes:
    num_clients = -(-num_classes // k)
  per_class = data.draw(st.integers(num_clients, num_clients + 40))
  labels = _balanced(per_class, num_classes, seed)
  clients = partition(labels, "shards", num_clients, seed=seed, classes_per_client=k)
  for idx in clients:
    assert np.unique(labels[idx]).size == k
  _check_disjoint_cover(clients, labels.size)


def test_shards_equal_sizes_when_balanced_and_varied_class_sets():
  labels = _balanced(600, 10)  # 6000 samples, 100 clients x 2 shards
  clients = partition(labels, "shards", 100, seed=0, classes_per_client=2)
  assert {c.size for c in clients} == {60}  # 200 shards of 30
  pairs = {tuple(np.unique(labels[c])) for c in clients}
  # A fixed stride layout would give only 5 distinct pairs; the switch chain mixes them.
  assert len(pairs) >= 25


def test_shards_unbalanced_classes_still_exact():
  labels = np.random.default_rng(5).permutation(np.repeat(np.arange(5), [200, 90, 40, 12, 8]))
  clients = partition(labels, "shards", 12, seed=5, classes_per_client=3)
  assert all(np.unique(labels[c]).size == 3 for c in clients)
  _check_disjoint_cover(clients, labels.size)


def test_shards_with_keep_per_client_keep_a_random_subset_of_each_clients_shards():
  """Each client keeps ``s`` of its own shards' samples (so still at most k classes), the split itself is the
  one without ``s`` (the subsets are drawn after it), the rest belong to no client, and the draw is seeded."""
  labels = _balanced(600, 10)  # 100 clients x 60 samples
  whole = partition(labels, "shards", 100, seed=3, classes_per_client=2)
  kept = partition(labels, "shards", 100, seed=3, classes_per_client=2, keep_per_client=55)
  assert [c.size for c in kept] == [55] * 100
  for full, part in zip(whole, kept):
    assert np.all(np.isin(part, full)) and np.all(np.diff(part) > 0)
    assert np.unique(labels[part]).size <= 2
  assert np.unique(np.concatenate(kept)).size == 5_500  # disjoint; 500 samples held by no client
  assert any(
    not np.array_equal(a, b)
    for a, b in zip(
      kept, partition(labels, "shards", 100, seed=4, classes_per_client=2, keep_per_client=55)
    )
  )
  with pytest.raises(ValueError, match=r"keep_per_client=61 too large for shards: .* holds 60"):
    partition(labels, "shards", 100, seed=3, classes_per_client=2, keep_per_client=61)


# --- by_writer --------------------------------------------------------------------------------


def test_by_writer_one_writer_per_client():
  n, num_writers = 300, 15
  writers = _writers(n, num_writers, 0)
  labels = np.zeros(n, np.int32)
  every = partition(labels, "by_writer", num_writers, seed=0, writers=writers)
  ids = [np.unique(writers[c]) for c in every]
  assert all(i.size == 1 for i in ids)
  np.testing.assert_array_equal(np.concatenate(ids), np.unique(writers))  # ordered by writer id
  for client, wid in zip(every, ids):
    np.testing.assert_array_equal(client, np.flatnonzero(writers == wid[0]))
  some = [partition(labels, "by_writer", 5, seed=s, writers=writers) for s in (0, 1)]
  chosen = [np.array([writers[c[0]] for c in clients]) for clients in some]
  assert all(np.all(np.diff(c) > 0) and np.isin(c, writers).all() for c in chosen)
  assert not np.array_equal(chosen[0], chosen[1])


# --- errors -----------------------------------------------------------------------------------


LABELS = _balanced(10, 4)  # N = 40, C = 4


@pytest.mark.parametrize(
  "method, num_clients, kwargs, match",
  [
    ("bogus", 2, {}, r"unknown partition method 'bogus'.*'iid', 'dirichlet'"),
    ("iid", 0, {}, r"num_clients must be an int >= 1, got 0"),
    ("iid", 2.5, {}, r"num_clients must be an int >= 1"),
    ("iid", 41, {}, r"num_clients=41 exceeds the 40 training samples"),
    ("dirichlet", 41, {}, r"num_clients=41 exceeds"),
    ("dirichlet", 2, dict(alpha=0.0), r"alpha must be a finite number > 0, got 0.0"),
    ("dirichlet", 2, dict(alpha=-1.0), r"alpha must be a finite number > 0"),
    (
      "dirichlet_fixed_size",
      2,
      dict(alpha=float("nan")),
      r"alpha must be a finite number > 0, got nan",
    ),
    (
      "dirichlet_fixed_size",
      2,
      dict(alpha=float("inf")),
      r"alpha must be a finite number > 0, got inf",
    ),
    ("iid", 4, dict(samples_per_client=11), r"samples_per_client=11 too large for iid"),
    ("iid", 4, dict(samples_per_client=0), r"samples_per_client must be an int >= 1, got 0"),
    (
      "dirichlet_fixed_size",
      2,
      dict(samples_per_client=11),
      r"samples_per_client=11 too large.*= 10",
    ),
    ("dirichlet_fixed_size", 2, {}, r"samples_per_client=20 too large"),  # default floor(40 / 2)
    ("shards", 4, dict(classes_per_client=5), r"classes_per_client must be an int in \[1, 4\]"),
    (
      "shards",
      4,
      dict(classes_per_client=0),
      r"classes_per_client must be an int in \[1, 4\].*got 0",
    ),
    ("shards", 1, dict(classes_per_client=2), r"need at least one shard per class"),
    ("shards", 12, dict(classes_per_client=4), r"a class can supply at most"),
    ("by_writer", 2, {}, r"by_writer needs `writers`"),
    ("by_writer", 2, dict(writers=np.arange(39)), r"writers must have shape \(40,\)"),
    ("by_writer", 6, dict(writers=np.arange(40) % 5), r"num_clients=6 exceeds the 5 writers"),
    ("iid", 2, dict(seed=None), r"seed must be an int, got None"),
  ],
)
def test_partition_errors(method, num_clients, kwargs, match):
  kwargs = {"seed": 0, **kwargs}
  with pytest.raises(ValueError, match=match):
    partition(LABELS, method, num_clients, **kwargs)


@pytest.mark.parametrize(
  "labels, match",
  [
    (np.zeros((3, 2), np.int32), r"1-D"),
    (np.zeros(0, np.int32), r"non-empty"),
    (np.array([0.0, 1.0]), r"integer class ids"),
    (np.array([0, -1, 2]), r"non-negative"),
  ],
)
def test_bad_labels(labels, match):
  with pytest.raises(ValueError, match=match):
    partition(labels, "iid", 1, seed=0)


# --- federation -------------------------------------------------------------------------------


@few
@given(
  sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
  extra=st.integers(0, 3),
  seed=st.integers(0, 2**31),
)
def test_federation_padding_and_round_trip(sizes, extra, seed):
  rng = np.random.default_rng(seed)
  n = 40
  x = rng.normal(size=(n, 3, 2)).astype(np.float64)
  y = rng.integers(10, size=n)
  clients = [rng.choice(n, size=s, replace=False) for s in sizes]
  n_max = max(sizes) + extra
  fed = make_federation(x, y, clients, n_max=n_max if extra else None)
  m = len(sizes)
  assert fed.x.shape == (m, n_max, 3, 2) and fed.x.dtype == np.float32
  assert fed.y.shape == (m, n_max) and fed.y.dtype == np.int32
  assert fed.mask.dtype == np.bool_ and fed.n.dtype == np.int32
  np.testing.assert_array_equal(fed.n, sizes)
  np.testing.assert_array_equal(fed.mask.sum(axis=1), sizes)
  for i, idx in enumerate(clients):
    assert fed.mask[i, : idx.size].all() and not fed.mask[i, idx.size :].any()
    np.testing.assert_array_equal(fed.x[i, : idx.size], x[idx].astype(np.float32))
    np.testing.assert_array_equal(fed.y[i, : idx.size], y[idx])
    assert not fed.x[i, idx.size :].any() and not fed.y[i, idx.size :].any()
  # Round trip: the masked rows, in order, are exactly the partitioned samples.
  np.testing.assert_array_equal(fed.x[fed.mask], x[np.concatenate(clients)].astype(np.float32))
  # One copy of the samples (plus the zero row padding points at), whatever the number of clients.
  assert (
    fed.samples_x.shape == (n + 1, 3, 2) and not fed.samples_x[n].any() and fed.samples_y[n] == 0
  )
  np.testing.assert_array_equal(fed.samples_x[:n], x.astype(np.float32))
  assert (
    fed.index.shape == (m, n_max)
    and fed.index.dtype == np.int32
    and (fed.index[~fed.mask] == n).all()
  )


def test_federation_shares_samples_between_clients():
  """Clients holding the same samples point at the same rows; the dataset is not copied per client."""
  x = np.arange(12, dtype=np.float32).reshape(6, 2)
  fed = make_federation(
    x, np.arange(6), [np.array([0, 1, 2]), np.array([2, 1]), np.array([1, 2, 0])]
  )
  assert fed.samples_x.shape == (7, 2)
  np.testing.assert_array_equal(fed.index, [[0, 1, 2], [2, 1, 6], [1, 2, 0]])
  gathered_x, gathered_y = fed.samples(fed.index[1])
  np.testing.assert_array_equal(gathered_x, [[4, 5], [2, 3], [0, 0]])
  np.testing.assert_array_equal(gathered_y, [2, 1, 0])


@few
@given(
  sizes=st.lists(st.integers(1, 9), min_size=1, max_size=9),
  blocks=st.integers(1, 4),
  extra=st.integers(0, 2),
  seed=st.integers(0, 2**31),
)
def test_block_layout_gives_each_client_its_samples_from_its_own_block(sizes, blocks, extra, seed):
  """Against make_federation: the same client data, each client's rows inside its device's block only."""
  rng = np.random.default_rng(seed)
  n = 30
  x, y = rng.normal(size=(n, 2)).astype(np.float32), rng.integers(10, size=n)
  clients = [rng.choice(n, size=s, replace=False) for s in sizes]
  n_max = max(sizes) + extra
  layout = block_layout(clients, n, blocks, n_max=n_max)
  whole = make_federation(x, y, clients, n_max=n_max)
  samples = [layout.block_samples(x, y, b) for b in range(blocks)]
  samples_x = np.concatenate([s[0] for s in samples])
  samples_y = np.concatenate([s[1] for s in samples])
  split = Federation(samples_x, samples_y, layout.index, layout.mask, layout.n)
  np.testing.assert_array_equal(split.x, whole.x)  # padding slots included: zero rows in both
  np.testing.assert_array_equal(split.y, whole.y)
  np.testing.assert_array_equal(layout.mask, whole.mask)
  np.testing.assert_array_equal(layout.n, whole.n)
  per_block = -(-len(sizes) // blocks)  # clients dealt as for_each_client deals them
  for m, idx in enumerate(clients):
    block = m // per_block
    assert (layout.index[m] // layout.block_size == block).all()
    assert set(idx) <= set(layout.rows[block])
  for b in range(blocks):  # a block holds its clients' samples, once each
    mine = clients[b * per_block : (b + 1) * per_block]
    expected = np.unique(np.concatenate(mine)) if mine else np.zeros(0, int)
    np.testing.assert_array_equal(layout.rows[b], expected)
    assert not samples_x[(b + 1) * layout.block_size - 1].any()  # every block ends in a zero row
  assert layout.block_size == max(r.size for r in layout.rows) + 1


def test_block_layout_errors():
  with pytest.raises(ValueError, match=r"num_blocks must be an int >= 1, got 0"):
    block_layout([np.array([0])], 5, 0)
  with pytest.raises(ValueError, match=r"client 0: indices must lie in \[0, 5\)"):
    block_layout([np.array([7])], 5, 2)


def test_federation_from_padded_keeps_every_slot():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 4, 2)).astype(np.float32)
  y = rng.integers(5, size=(3, 4)).astype(np.int32)
  mask = np.arange(4)[None] < np.array([[4], [1], [2]])
  fed = federation_from_padded(x, y, mask)
  np.testing.assert_array_equal(fed.x, x)  # padding slots keep their values
  np.testing.assert_array_equal(fed.y, y)
  np.testing.assert_array_equal(fed.n, [4, 1, 2])
  with pytest.raises(ValueError, match=r"share their first two axes"):
    federation_from_padded(x, y[:, :3], mask)


def test_federation_is_a_pytree():
  fed = make_federation(np.ones((4, 2)), np.arange(4), [np.array([0, 1]), np.array([3])])
  leaves = jax.tree_util.tree_leaves(fed)
  assert len(leaves) == 5
  doubled = jax.tree_util.tree_map(lambda a: a.shape[0], fed)
  assert isinstance(doubled, Federation) and doubled == Federation(5, 5, 2, 2, 2)


@pytest.mark.parametrize(
  "clients, kwargs, match",
  [
    (
      [np.array([0, 1, 2]), np.array([3])],
      dict(n_max=2),
      r"n_max must be an int >= the largest client \(3",
    ),
    ([np.array([0]), np.array([], np.int64)], {}, r"client 1 has no samples"),
    ([np.array([0, 9])], {}, r"client 0: indices must lie in \[0, 5\)"),
    ([np.array([-1])], {}, r"must lie in \[0, 5\)"),
    ([np.array([[0, 1]])], {}, r"client 0: indices must be a 1-D integer array"),
    ([np.array([0.0])], {}, r"1-D integer array"),
    ([], {}, r"client_indices is empty"),
  ],
)
def test_federation_errors(clients, kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_federation(np.zeros((5, 2)), np.zeros(5, np.int32), clients, **kwargs)


def test_federation_mismatched_x_y():
  with pytest.raises(ValueError, match=r"share the sample axis"):
    make_federation(np.zeros((5, 2)), np.zeros(4, np.int32), [np.array([0])])


# --- plot -------------------------------------------------------------------------------------


def test_plot_label_distribution_writes_png(tmp_path):
  labels = _balanced(50, 10)
  clients = partition(labels, "dirichlet", 60, seed=0, alpha=0.3)
  path = tmp_path / "sub" / "labels.png"
  plot_label_distribution(labels, clients, 10, path, max_clients=40)
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  import matplotlib.image

  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_class_counts_brute_force():
  labels = _labels(50, 3, 1)
  clients = partition(labels, "iid", 4, seed=1)
  counts = class_counts(labels, clients, 3)
  expected = [[sum(labels[i] == c for i in idx) for c in range(3)] for idx in clients]
  np.testing.assert_array_equal(counts, expected)


@pytest.mark.parametrize(
  "num_classes, kwargs, match",
  [
    (2, {}, r"labels must lie in \[0, num_classes=2\)"),
    (0, {}, r"num_classes must be an int >= 1"),
    (3, dict(max_clients=0), r"max_clients must be an int >= 1"),
  ],
)
def test_plot_errors(tmp_path, num_classes, kwargs, match):
  labels = np.array([0, 1, 2, 2])
  with pytest.raises(ValueError, match=match):
    plot_label_distribution(labels, [np.arange(4)], num_classes, tmp_path / "x.png", **kwargs)
