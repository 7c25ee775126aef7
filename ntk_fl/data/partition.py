"""Split a training set's indices over federated clients.

One entry point, :func:`partition`, with seven methods (``PARTITIONS``):

* ``iid``: a seeded random permutation cut into ``num_clients`` near-equal
  parts, or exactly ``samples_per_client`` each when given. Disjoint.
* ``dirichlet``: Hsu et al. (2019) label skew, disjoint. For every class, its
  samples are split over the clients with proportions ``p ~ Dir(alpha 1_M)``;
  every sample is used exactly once. Small ``alpha`` with many clients leaves
  clients empty; instead of an unbounded rejection loop (a known failure of
  other FL libraries) the whole split is redrawn at most ``DIRICHLET_DRAWS``
  times and then repaired deterministically (see :func:`_fill_empty_clients`).
* ``dirichlet_fixed_size``: the generator of the NTK-FL / NTK-DFL authors, which
  produced the partitions of their papers. Clients have ``samples_per_client``
  samples (minus floor truncation) with label proportions ``q ~ Dir(alpha 1_C)``;
  samples are unique within a client but *overlap across clients* (about 37.9k
  of Fashion-MNIST's 60k images are used at 300 clients).
* ``shards``: McMahan et al. (2017) pathological non-IID split: every client
  holds shards of exactly ``classes_per_client`` distinct classes. Disjoint.
  With ``keep_per_client``, each client then keeps a uniformly random
  ``keep_per_client`` of its shards' samples (the rest are no client's:
  e.g. FedBE's unlabelled server set).
* ``by_writer``: the natural split of handwriting data (FEMNIST), one client per
  writer.
* ``contiguous``: client ``i`` holds ``arange(s i, s i + s)`` in training-set
  order (``s = samples_per_client``, default ``floor(N / M)``). No randomness.
  This is the split the NTK-FL authors' code falls back to when its partition
  file is missing (its shipped configuration names a file that does not exist,
  so the code's default run uses this split: IID in effect, since the
  Fashion-MNIST training files are not sorted by label).
* ``index_map``: read from a file (:mod:`ntk_fl.data.index_map`), e.g. the
  authors' own Fashion-MNIST partitions shipped with the package.

Every method is deterministic in ``seed`` and runs in bounded time. Each
client's indices are returned sorted ascending (local training shuffles them),
except ``index_map``'s, which keep the file's order.
"""

from __future__ import annotations

import numbers

import numpy as np

from ntk_fl import validation
from ntk_fl._src.names import PARTITIONS  # re-exported: the schema reads it from the leaf
from ntk_fl.data import index_map
from ntk_fl.rng import Stream, numpy_rng

__all__ = ["partition", "PARTITIONS", "DIRICHLET_DRAWS", "SHARD_SWAPS_PER_EDGE"]


# Full redraws of the disjoint Dirichlet split before empty clients are repaired.
DIRICHLET_DRAWS = 10
# Attempted switches per (client, class) edge when randomising the shard assignment.
SHARD_SWAPS_PER_EDGE = 20


def partition(
  labels: np.ndarray,
  method: str,
  num_clients: int,
  *,
  seed: int,
  alpha: float = 0.5,
  samples_per_client: int | None = None,
  classes_per_client: int = 2,
  keep_per_client: int | None = None,
  writers: np.ndarray | None = None,
  partition_file: str | None = None,
) -> list[np.ndarray]:
  """Assign training-set indices to ``num_clients`` clients.

  Args:
    labels: ``[N]`` non-negative integer class ids of the training set. The
      number of classes ``C`` is ``labels.max() + 1``.
    method: one of ``PARTITIONS`` (see the module docstring).
    num_clients: ``M >= 1``; at most ``N`` (at most the number of writers for
      ``by_writer``).
    seed: seeds every random draw (``numpy.random.default_rng(seed)``, the
      ``rng.Stream.PARTITION`` stream).
    alpha: Dirichlet concentration (``dirichlet``, ``dirichlet_fixed_size``);
      finite and ``> 0``. Small = skewed, large = near-IID.
    samples_per_client: ``iid``: exactly this many per client (``M * s <= N``;
      ``None`` = all samples, near-equal parts). ``dirichlet_fixed_size``: the
      target size (``None`` = ``floor(N / M)``; at most ``floor(N / C)``).
      ``contiguous``: the block length (``None`` = ``floor(N / M)``; ``M * s <= N``).
      Ignored by the other methods.
    classes_per_client: ``shards`` only: distinct classes per client, between 1
      and the number of classes present.
    keep_per_client: ``shards`` only: each client keeps a uniformly random this
      many of its shards' samples, drawn after the split (``None`` = all; at
      most the smallest client's count).
    writers: ``by_writer`` only: ``[N]`` writer id of each sample.
    partition_file: ``index_map`` only: a ``.npz`` index map or the name of a
      shipped one (:func:`ntk_fl.data.index_map.resolve`); it must hold
      ``num_clients`` clients with indices in ``[0, N)``.

  Returns:
    ``M`` int64 arrays of indices into the training set, non-empty and sorted
    ascending (``index_map``: in the file's order).

  Raises:
    ValueError: for an unknown method or a request that cannot be met, naming
      the bad value and what is allowed.
  """
  labels = _check_labels(labels)
  if method not in PARTITIONS:
    raise ValueError(f"unknown partition method {method!r}; expected one of {PARTITIONS}")
  num_clients = _check_int("num_clients", num_clients, minimum=1)
  if method != "by_writer" and num_clients > labels.size:
    raise ValueError(
      f"num_clients={num_clients} exceeds the {labels.size} training samples; "
      "every client needs at least one sample"
    )
  if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
    raise ValueError(f"seed must be an int, got {seed!r}")
  if samples_per_client is not None:
    samples_per_client = _check_int("samples_per_client", samples_per_client, minimum=1)
  if keep_per_client is not None:
    keep_per_client = _check_int("keep_per_client", keep_per_client, minimum=1)
  if method == "index_map":
    if partition_file is None:
      raise ValueError(
        "partition method 'index_map' needs partition_file (a .npz index map or a "
        "shipped map's name)"
      )
    return index_map.load_index_map(
      partition_file, num_clients=num_clients, num_samples=labels.size
    )
  if method == "contiguous":
    return _contiguous(labels.size, num_clients, samples_per_client)
  rng = numpy_rng(seed, Stream.PARTITION)

  if method == "iid":
    clients = _iid(labels.size, num_clients, samples_per_client, rng)
  elif method == "dirichlet":
    clients = _dirichlet(labels, num_clients, _check_alpha(alpha), rng)
  elif method == "dirichlet_fixed_size":
    clients = _dirichlet_fixed_size(
      labels, num_clients, _check_alpha(alpha), samples_per_client, rng
    )
  elif method == "shards":
    clients = _shards(labels, num_clients, classes_per_client, rng)
    if keep_per_client is not None:
      clients = _keep_subsets(clients, keep_per_client, rng)
  else:
    clients = _by_writer(labels.size, num_clients, writers, rng)
  return [np.sort(np.asarray(c, dtype=np.int64)) for c in clients]


def _keep_subsets(clients, size: int, rng: np.random.Generator) -> list[np.ndarray]:
  """Each client's uniformly random ``size`` of its samples, drawn client after client (after the split)."""
  smallest = min(len(c) for c in clients)
  if size > smallest:
    raise ValueError(
      f"keep_per_client={size} too large for shards: the smallest client holds {smallest} samples"
    )
  return [np.asarray(c)[rng.choice(len(c), size=size, replace=False)] for c in clients]


# --- validation -------------------------------------------------------------------------------


def _check_labels(labels) -> np.ndarray:
  labels = np.asarray(labels)
  if labels.ndim != 1 or labels.size == 0:
    raise ValueError(f"labels must be a non-empty 1-D array, got shape {labels.shape}")
  if not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f"labels must hold integer class ids, got dtype {labels.dtype}")
  if labels.min() < 0:
    raise ValueError(f"labels must be non-negative class ids, got minimum {labels.min()}")
  return labels.astype(np.int64)


def _check_int(name: str, value, *, minimum: int) -> int:
  return validation.check_int(name, value, low=minimum)


def _check_alpha(alpha) -> float:
  if not isinstance(alpha, numbers.Real) or not np.isfinite(alpha) or alpha <= 0:
    raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
  return float(alpha)


# --- iid --------------------------------------------------------------------------------------


def _iid(
  num_samples: int, num_clients: int, samples_per_client: int | None, rng: np.random.Generator
) -> list[np.ndarray]:
  perm = rng.permutation(num_samples)
  if samples_per_client is None:
    return np.array_split(perm, num_clients)
  if num_clients * samples_per_client > num_samples:
    raise ValueError(
      f"samples_per_client={samples_per_client} too large for iid: {num_clients} disjoint clients "
      f"need {num_clients * samples_per_client} samples but there are {num_samples}"
    )
  return np.split(perm[: num_clients * samples_per_client], num_clients)


# --- contiguous (the NTK-FL code's fallback) --------------------------------------------------


def _contiguous(
  num_samples: int, num_clients: int, samples_per_client: int | None
) -> list[np.ndarray]:
  size = num_samples // num_clients if samples_per_client is None else samples_per_client
  if num_clients * size > num_samples:
    raise ValueError(
      f"samples_per_client={size} too large for contiguous: {num_clients} blocks of {size} need "
      f"{num_clients * size} samples but there are {num_samples}"
    )
  return [np.arange(i * size, (i + 1) * size, dtype=np.int64) for i in range(num_clients)]


# --- dirichlet (disjoint, Hsu et al. 2019) ----------------------------------------------------


def _dirichlet(
  labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
  for _ in range(DIRICHLET_DRAWS):
    owner = _dirichlet_owners(labels, num_clients, alpha, rng)
    if np.bincount(owner, minlength=num_clients).min() > 0:
      break
  else:
    owner = _fill_empty_clients(owner, labels, num_clients)
  return _group(owner, num_clients)


def _dirichlet_owners(
  labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> np.ndarray:
  """``[N]`` client of every sample: each class split over clients by ``Dir(alpha 1_M)``."""
  owner = np.empty(labels.size, dtype=np.int64)
  for c in np.unique(labels):
    members = rng.permutation(np.flatnonzero(labels == c))
    proportions = rng.dirichlet(np.full(num_clients, alpha))
    # Cut points from the cumulative proportions; the last client takes the rounding remainder.
    cuts = np.clip(np.round(np.cumsum(proportions)[:-1] * members.size), 0, members.size)
    counts = np.diff(np.concatenate([[0], cuts, [members.size]])).astype(np.int64)
    owner[members] = np.repeat(np.arange(num_clients), counts)
  return owner


def _fill_empty_clients(owner: np.ndarray, labels: np.ndarray, num_clients: int) -> np.ndarray:
  """Give every empty client one sample, taken from the currently largest client.

  Deterministic and bounded (one move per empty client). The donor gives up a
  sample of its most frequent class, so its label skew changes least. A donor
  with >= 2 samples always exists while a client is empty because ``N >= M``.
  """
  owner = owner.copy()
  counts = np.bincount(owner, minlength=num_clients)
  for empty in np.flatnonzero(counts == 0):
    donor = int(np.argmax(counts))
    held = np.flatnonzero(owner == donor)
    majority = np.argmax(np.bincount(labels[held]))
    moved = held[labels[held] == majority][-1]
    owner[moved] = empty
    counts[donor] -= 1
    counts[empty] += 1
  return owner


def _group(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
  order = np.argsort(owner, kind="stable")
  return np.split(order, np.cumsum(np.bincount(owner, minlength=num_clients))[:-1])


# --- dirichlet_fixed_size (the NTK-FL / NTK-DFL authors' generator) ---------------------------


def _dirichlet_fixed_size(
  labels: np.ndarray,
  num_clients: int,
  alpha: float,
  samples_per_client: int | None,
  rng: np.random.Generator,
) -> list[np.ndarray]:
  """The generator behind the partitions shipped with the NTK-FL/NTK-DFL code.

  1. ``samples_per_client`` defaults to ``floor(N / M)`` (200 for Fashion-MNIST
     with 300 clients).
  2. The training indices, sorted by label (stable), are cut into ``C``
     consecutive pools of ``P = floor(N / C)`` indices; each pool is shuffled.
     As in the authors' code the pools are class-pure only when the classes are
     exactly balanced (Fashion-MNIST); on unbalanced data (MNIST) pool ``c``
     also holds neighbouring classes' samples, and the last ``N - C P`` sorted
     indices are never used. Equal pools of ``P >= samples_per_client`` indices
     mean a pool can never run short of the requested count.
  3. Per client: ``q ~ Dir(alpha 1_C)``, histogram ``h = floor(s q)``; take the
     first ``h[c]`` indices of pool ``c``, then reshuffle that pool. Samples are
     therefore unique within a client but repeat across clients, and sizes are
     ``s - C + 1 <= sum(h) <= s``.

  Only when ``s < C`` can the floors all be zero; such a client gets one
  sample of its most likely class (never triggered for ``s >= C``).
  """
  num_samples = labels.size
  num_classes = int(labels.max()) + 1
  pool_size = num_samples // num_classes
  if samples_per_client is None:
    samples_per_client = num_samples // num_clients
  if samples_per_client > pool_size:
    raise ValueError(
      f"samples_per_client={samples_per_client} too large for dirichlet_fixed_size: it must be at "
      f"most the class-pool size floor(N / C) = {num_samples} // {num_classes} = {pool_size}"
    )
  by_label = np.argsort(labels, kind="stable")[: num_classes * pool_size]
  pools = rng.permuted(by_label.reshape(num_classes, pool_size), axis=1)
  clients = []
  for _ in range(num_clients):
    q = rng.dirichlet(np.full(num_classes, alpha))
    hist = np.floor(samples_per_client * q).astype(np.int64)
    if hist.sum() == 0:
      hist[np.argmax(q)] = 1
    drawn = np.flatnonzero(hist)
    clients.append(np.concatenate([pools[c, : hist[c]] for c in drawn]))
    for c in drawn:
      rng.shuffle(pools[c])
  return clients


# --- shards (McMahan et al. 2017) -------------------------------------------------------------


def _shards(
  labels: np.ndarray, num_clients: int, classes_per_client, rng: np.random.Generator
) -> list[np.ndarray]:
  """Each client gets one shard from each of exactly ``k`` distinct classes.

  Guarantee: every sample is used exactly once and every client holds samples
  of exactly ``k`` distinct classes, whenever that is possible; otherwise a
  ValueError. Construction:

  1. Shard counts ``s_c`` per class, proportional to class size, with
     ``1 <= s_c <= min(M, n_c)`` and ``sum s_c = M k`` (feasible iff
     ``C <= M k <= sum_c min(M, n_c)``). Class ``c``'s shuffled samples are cut
     into ``s_c`` near-equal shards (all shards equal for balanced classes, as
     McMahan's equal-size shards).
  2. A client-class incidence (bipartite graph, client degree ``k``, class
     degree ``s_c``, no repeated pairs) exists iff every ``s_c <= M``: lay the
     shards out grouped by class and give client ``i`` slots ``i, i + M, ...,
     i + (k-1) M``; a class block is at most ``M`` long, so those slots are
     distinct classes.
  3. That layout is randomised by ``SHARD_SWAPS_PER_EDGE * M k`` attempted
     degree-preserving switches ``(i, a), (j, b) -> (i, b), (j, a)`` (rejected if
     they would repeat a pair). The switch chain is irreducible on such graphs
     (Ryser), so the result is close to a uniform draw, unlike the fixed
     stride layout. (networkx's edge swaps do not preserve bipartiteness.)
  """
  classes, class_sizes = np.unique(labels, return_counts=True)
  num_classes = classes.size
  if (
    not isinstance(classes_per_client, numbers.Integral)
    or isinstance(classes_per_client, bool)
    or not 1 <= classes_per_client <= num_classes
  ):
    raise ValueError(
      f"classes_per_client must be an int in [1, {num_classes}] (the number of "
      f"classes present), got {classes_per_client!r}"
    )
  k = int(classes_per_client)
  total = num_clients * k
  caps = np.minimum(class_sizes, num_clients)
  if total < num_classes:
    raise ValueError(
      f"shards cannot use all {num_classes} classes with num_clients * classes_per_client = "
      f"{num_clients} * {k} = {total} shards; need at least one shard per class"
    )
  if total > caps.sum():
    raise ValueError(
      f"shards cannot give {num_clients} clients {k} distinct classes each: a class can supply at "
      f"most min(num_clients, its size) shards, {int(caps.sum())} in total, but {total} are needed"
    )
  shard_counts = _allocate_shards(class_sizes, total, caps)
  slot_class = np.repeat(np.arange(num_classes), shard_counts)
  edges_client = np.tile(np.arange(num_clients), k)  # slot t -> client t mod M
  edges_class = _switch_randomise(edges_client, slot_class, num_clients, k, rng)

  clients: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
  for c in range(num_classes):
    members = rng.permutation(np.flatnonzero(labels == classes[c]))
    holders = rng.permutation(edges_client[edges_class == c])
    for holder, shard in zip(holders, np.array_split(members, shard_counts[c])):
      clients[holder].append(shard)
  return [np.concatenate(parts) for parts in clients]


def _allocate_shards(class_sizes: np.ndarray, total: int, caps: np.ndarray) -> np.ndarray:
  """Integer shard counts ``1 <= s <= caps`` summing to ``total``, close to proportional.

  Starts from the clipped floor of the proportional target and moves one shard
  at a time towards the target; bounded by ``total`` steps.
  """
  target = total * class_sizes / class_sizes.sum()
  counts = np.clip(np.floor(target).astype(np.int64), 1, caps)
  while counts.sum() < total:
    room = np.where(counts < caps, target - counts, -np.inf)
    counts[np.argmax(room)] += 1
  while counts.sum() > total:
    excess = np.where(counts > 1, counts - target, -np.inf)
    counts[np.argmax(excess)] -= 1
  return counts


def _switch_randomise(
  edges_client: np.ndarray,
  edges_class: np.ndarray,
  num_clients: int,
  k: int,
  rng: np.random.Generator,
) -> np.ndarray:
  """Randomise the class of each (client, class) edge by degree-preserving switches."""
  num_edges = edges_class.size
  client = edges_client.tolist()
  cls = edges_class.tolist()
  held = [set() for _ in range(num_clients)]
  for i, c in zip(client, cls):
    held[i].add(c)
  assert all(len(h) == k for h in held), "stride layout must give k distinct classes"
  # Plain Python ints: the loop is a sequential Markov chain, and scalar numpy indexing is slower.
  for a, b in rng.integers(num_edges, size=(SHARD_SWAPS_PER_EDGE * num_edges, 2)).tolist():
    ia, ca, ib, cb = client[a], cls[a], client[b], cls[b]
    if ca == cb or cb in held[ia] or ca in held[ib]:
      continue
    held[ia].remove(ca)
    held[ia].add(cb)
    held[ib].remove(cb)
    held[ib].add(ca)
    cls[a], cls[b] = cb, ca
  return np.asarray(cls, dtype=np.int64)


# --- by_writer --------------------------------------------------------------------------------


def _by_writer(
  num_samples: int, num_clients: int, writers: np.ndarray | None, rng: np.random.Generator
) -> list[np.ndarray]:
  """One client per writer; ``M`` writers chosen by a seeded draw, ordered by writer id.

  With ``M`` equal to the number of writers every writer is a client (the seed
  does not matter); with fewer, a seeded uniform subset of writers is used.
  """
  if writers is None:
    raise ValueError(
      "by_writer needs `writers` (the writer id of each training sample); the dataset has none"
    )
  writers = np.asarray(writers)
  if writers.shape != (num_samples,):
    raise ValueError(f"writers must have shape ({num_samples},) like labels, got {writers.shape}")
  ids, inverse, sizes = np.unique(writers, return_inverse=True, return_counts=True)
  if num_clients > ids.size:
    raise ValueError(
      f"num_clients={num_clients} exceeds the {ids.size} writers; by_writer makes "
      "one client per writer"
    )
  chosen = np.sort(rng.choice(ids.size, size=num_clients, replace=False))
  groups = np.split(np.argsort(inverse, kind="stable"), np.cumsum(sizes)[:-1])
  return [groups[w] for w in chosen]
