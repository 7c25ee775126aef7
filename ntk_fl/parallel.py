"""The one place that maps a per-client function over the stacked client axis.

Every algorithm in ``ntk_fl`` expresses its per-client work as a function of one
client's slice (no leading ``M`` axis) and lifts it with :func:`for_each_client`.
Keeping the mapping in one place means the memory/parallelism policy changes
here and nowhere else; algorithm code is identical on 1 and on N devices.

Two layers, chosen when the lifted function is *traced*:

* **Chunked ``vmap``** (always, per device): ``chunk_size`` clients at a time
  (``lax.map`` with ``batch_size``), so peak memory grows with the chunk, not
  with ``M``. ``0`` maps all local clients at once. The chunk size is part of
  the device policy: :func:`use_devices` sets it (the runner enters it with
  ``config.devices`` and ``config.chunk_size``), and a :func:`for_each_client`
  without an explicit ``chunk_size`` uses it (all at once outside any policy).
* **Sharding over devices**, inside :func:`use_devices` when it spans more than one device: the mapped
  arguments are split along their client axis over a mesh with one axis
  ``'clients'`` (:data:`CLIENTS`) by ``jax.shard_map`` (``P('clients')``), every
  array the function *captures* (closure constants, e.g. every client's index
  list) is replicated, an argument passed as a :class:`Shared` (NTK-DFL's
  round-start weights and samples, which clients read their neighbours' rows
  of) enters whole -- as per-device blocks when it is split, its rows then
  fetched from the devices that hold them -- and the outputs come back stacked
  ``P('clients')``. ``M`` need not divide the device count: the
  client axis is padded to a multiple of it with copies of the last client (real
  inputs, so the padding computes nothing non-finite) and the padded rows are
  dropped afterwards. Inside each shard the chunking above still applies, so
  memory stays bounded *per device*.

The device policy is read when the lifted function is **traced**, and ``jit``
reuses a trace: call a jitted step for the first time inside the
:func:`use_devices` context you want (the runner builds and runs everything
inside it). It is ntk_fl's own context rather than ``jax.set_mesh`` on purpose:
under a context mesh, values computed in the enclosing ``jit`` and captured by
the per-client function (NTK-DFL's padded neighbourhood data) carry that mesh in
their types and cannot be indexed inside ``shard_map`` (jax 0.10 raises "Context
mesh ... should match the mesh of sharding"). A ``for_each_client`` nested in
another one's per-client function (the ``'clients'`` axis already manual) is
not split again.

Several processes (hosts): after :func:`ntk_fl.distributed.initialize`
(``experiments/main.py --num_processes=P`` or ``--distributed``) ``jax.devices()``
lists every process's devices and :func:`make_client_mesh` spans them all, so the
``'clients'`` axis is split over processes too and each process computes the
clients on its own devices. Every process runs the same program on the same inputs
(the runner's data and round inputs are deterministic in the config seed); inputs
passed as numpy or uncommitted arrays count as replicated.

Debug mode (``use_devices(debug=True)``, ``config.debug_clients``; as FedJAX's debug
backend of ``for_each_client``): nothing is compiled (``jax.disable_jit``) and every
:func:`for_each_client` runs its function client by client in a Python loop, on one
device, so a breakpoint or a print inside it sees concrete values; an exception raised
for a client comes back as a :class:`ClientError` that names the client's index and the
stage (the per-client function's name). Results equal the mapped ones up to float rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from ntk_fl import validation
from ntk_fl._src.names import (
  CLIENTS,
)  # the mesh axis; a leaf, so the multi-process code names it alone

__all__ = [
  "CLIENTS",
  "ClientError",
  "debug_clients",
  "for_each_client",
  "for_each_client_by_group",
  "make_client_mesh",
  "use_devices",
  "num_client_shards",
  "current_mesh",
  "policy_chunk_size",
  "Shared",
  "is_client_split",
  "to_device",
]


_STATE = (
  threading.local()
)  # .policies: the stack of use_devices: (mesh or None = single device, chunk_size, debug)


class ClientError(RuntimeError):
  """An exception raised by a per-client function in debug mode, naming the client and the stage.

  Attributes:
    client: the client's index along the mapped client axis.
    stage: the per-client function's name (``for_each_client``'s ``fn``).
  """

  def __init__(self, client: int, stage: str, cause: BaseException):
    super().__init__(f"client {client}, stage {stage!r}: {type(cause).__name__}: {cause}")
    self.client = client
    self.stage = stage


def _current_policy() -> tuple[Mesh | None, int, bool]:
  policies = getattr(_STATE, "policies", None)
  return policies[-1] if policies else (None, 0, False)


def _current_mesh() -> Mesh | None:
  return _current_policy()[0]


def debug_clients() -> bool:
  """Whether the innermost :func:`use_devices` is in debug mode (a Python loop over clients, no jit)."""
  return _current_policy()[2]


def policy_chunk_size() -> int:
  """Clients per chunk of the innermost :func:`use_devices` (``0`` = all at once, also outside any)."""
  return _current_policy()[1]


def current_mesh() -> Mesh | None:
  """The mesh of the innermost :func:`use_devices` context (``None``: single-device path or no context)."""
  return _current_mesh()


def make_client_mesh(devices: int | Sequence[jax.Device] = 0) -> Mesh:
  """A 1-D :class:`jax.sharding.Mesh` with axis :data:`CLIENTS`.

  Args:
    devices: ``0`` = every device ``jax.devices()`` lists (all hosts' after
      ``jax.distributed.initialize()``); ``n > 0`` = the first ``n`` of them; or
      an explicit sequence of devices.

  Raises:
    ValueError: ``devices`` is negative, not an int, or more than exist.
  """
  if isinstance(devices, Sequence) and not isinstance(devices, (str, bytes)):
    chosen = list(devices)
    if not chosen:
      raise ValueError("make_client_mesh needs at least one device, got an empty sequence")
  else:
    available = jax.devices()
    count = validation.check_int("devices (0 = all)", devices, low=0)
    if count > len(available):
      raise ValueError(
        f"devices = {count} but only {len(available)} {available[0].platform} device(s) exist; "
        f"use 0 for all of them or a number in [1, {len(available)}]"
      )
    chosen = available[: count or len(available)]
  # Auto (not Explicit) axes: XLA's partitioner places the rest of the step around the shard_map.
  return Mesh(np.asarray(chosen), (CLIENTS,), axis_types=(AxisType.Auto,))


@contextlib.contextmanager
def use_devices(
  devices: int | Sequence[jax.Device] = 0, *, chunk_size: int = 0, debug: bool = False
) -> Iterator[Mesh | None]:
  """The device policy: every :func:`for_each_client` *traced* inside shards clients over ``devices``.

  Args:
    devices: as in :func:`make_client_mesh`. ``1`` (or ``0`` on a one-device
      machine) is the single-device path: no mesh.
    chunk_size: clients per ``vmap`` chunk on each device for every
      :func:`for_each_client` that does not name its own (``0`` = all at once).
    debug: the debug mode (see the module docstring): no jit, one client at a
      time on one device (``devices`` and ``chunk_size`` are then not used), and
      a :class:`ClientError` naming the client and the stage.

  Yields:
    The mesh, or ``None`` on the single-device path (always in debug mode).

  Contexts nest (the innermost wins) and are per thread.
  """
  chunk_size = validation.check_int("chunk_size (0 = all clients at once)", chunk_size, low=0)
  if not isinstance(debug, bool):
    raise ValueError(f"debug must be True or False, got {debug!r}")
  mesh = make_client_mesh(devices)
  if not hasattr(_STATE, "policies"):
    _STATE.policies = []
  _STATE.policies.append((mesh if mesh.size > 1 and not debug else None, chunk_size, debug))
  try:
    with jax.disable_jit() if debug else contextlib.nullcontext():
      yield _STATE.policies[-1][0]
  finally:
    _STATE.policies.pop()


def num_client_shards() -> int:
  """Devices :func:`for_each_client` splits clients over at this point of tracing (``1`` = unsharded)."""
  mesh = _current_mesh()
  if mesh is None or CLIENTS in jax.sharding.get_abstract_mesh().manual_axes:
    return 1
  return int(mesh.shape[CLIENTS])


@dataclasses.dataclass(frozen=True)
class Shared:
  """Arrays every client's function reads rows of, passed to a :func:`for_each_client` function whole.

  A ``Shared`` argument of a mapped function is not sliced per client: the
  function receives it as it is and reads rows with :meth:`take`. Its leaves
  share a leading *row* axis (every client's weights ``[M, ...]``, or a
  federation's samples ``[S, ...]``).

  ``split=True`` says the rows are stored in equal contiguous blocks, one per
  device of the ``'clients'`` mesh (a jax array sharded ``P('clients')``, as
  :func:`ntk_fl.distributed.place_federation` builds the samples of a
  multi-process run): each device holds only its block, and inside the
  sharded map :meth:`take` fetches the rows a chunk of clients asks for from
  the devices that hold them (an ``all_gather`` of the row numbers, each device
  contributing the rows it holds, a ``psum_scatter`` back to the asker), so no
  device ever holds the whole array. ``split=False`` rows are replicated on
  every device and read directly.

  Attributes:
    tree: a pytree of arrays with a common leading row axis.
    split: whether ``tree`` is split in per-device blocks (see above).
  """

  tree: Any
  split: bool = False

  def take(self, rows):
    """``tree``'s leaves at ``rows`` (int array ``[...]`` of row numbers): leaves ``[..., *row_shape]``."""
    if self.split and CLIENTS in jax.sharding.get_abstract_mesh().manual_axes:
      return jax.tree.map(lambda block: _take_from_blocks(block, rows), self.tree)
    return jax.tree.map(lambda leaf: jnp.asarray(leaf)[rows], self.tree)


def _take_from_blocks(block, rows):
  """Rows of an array split in per-device blocks, inside ``shard_map`` over :data:`CLIENTS` (see :class:`Shared`).

  Every device asks for ``rows`` (global row numbers); each contributes the asked
  rows in its ``block`` (zeros elsewhere) and the reduce-scatter hands every
  device the sum for its own request -- exactly the asked rows, as each row has
  one holder and the others add zeros.
  """
  me = jax.lax.axis_index(CLIENTS)
  size = block.shape[0]
  requests = jax.lax.all_gather(rows, CLIENTS)  # [D, ...]
  mine = requests // size == me
  values = block[jnp.where(mine, requests - me * size, 0)]  # [D, ..., *row_shape]
  values = jnp.where(
    mine.reshape(mine.shape + (1,) * (block.ndim - 1)), values, jnp.zeros((), block.dtype)
  )
  return jax.lax.psum_scatter(values, CLIENTS, scatter_dimension=0, tiled=False)


def to_device(tree):
  """``tree`` with its numpy leaves put on the default device and its jax arrays kept where they are.

  ``jax.device_put`` of a whole federation would try to move arrays already placed
  across processes (:func:`ntk_fl.distributed.place_federation`) onto one device.
  """
  return jax.tree.map(
    lambda leaf: leaf if isinstance(leaf, jax.Array) else jax.device_put(leaf), tree
  )


def is_client_split(array) -> bool:
  """Whether ``array`` is a jax array split over the ``'clients'`` axis of a mesh of more than one device."""
  sharding = getattr(array, "sharding", None)
  if (
    not isinstance(sharding, jax.sharding.NamedSharding) or CLIENTS not in sharding.mesh.axis_names
  ):
    return False
  spec = tuple(sharding.spec)
  return bool(spec) and spec[0] == CLIENTS and sharding.mesh.shape[CLIENTS] > 1


def _num_clients(stacked_args) -> int:
  leaves = jax.tree_util.tree_leaves(stacked_args)
  if not leaves:
    raise ValueError("for_each_client needs at least one array argument with a client axis")
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    shapes = sorted({str(np.shape(leaf)) for leaf in leaves})
    raise ValueError(
      "every argument leaf of a for_each_client function needs the same leading client axis M; "
      f"got leaf shapes {shapes}"
    )
  return sizes.pop()


def _chunked(fn, chunk_size, stacked_args):
  """``fn`` over the leading axis of ``stacked_args``, ``chunk_size`` clients at a time."""
  num_clients = _num_clients(stacked_args)
  if not chunk_size or chunk_size >= num_clients:
    return jax.vmap(fn)(*stacked_args)
  return jax.lax.map(lambda args: fn(*args), stacked_args, batch_size=chunk_size)


def _grouped(fns, chunk_size, stacked_args):
  """Client ``i`` runs ``fns[group[i]]`` (``group = stacked_args[0]``), each group ``chunk_size`` clients at a time.

  The clients are ordered by group (stable); group ``g``'s clients are mapped chunk by chunk in a loop of
  ``ceil(count_g / chunk_size)`` trips (so a group nobody is in this round costs nothing), and each chunk's
  outputs are scattered back to its clients' rows. A last chunk's unused lanes repeat the chunk's first
  client (real inputs: they compute nothing non-finite) and their outputs are dropped.
  """
  num_clients = _num_clients(stacked_args)
  if len(fns) == 1 or not chunk_size or chunk_size >= num_clients:
    return _chunked(fns[-1], chunk_size, stacked_args)
  group = jnp.clip(jnp.asarray(stacked_args[0]).astype(jnp.int32), 0, len(fns) - 1)
  shapes = jax.eval_shape(fns[-1], *jax.tree.map(lambda leaf: leaf[0], stacked_args))
  out = jax.tree.map(lambda s: jnp.zeros((num_clients, *s.shape), s.dtype), shapes)
  counts = jnp.bincount(group, length=len(fns))
  starts = jnp.cumsum(counts) - counts
  # Room for a last chunk that runs past the end of the order.
  order = jnp.concatenate([jnp.argsort(group, stable=True), jnp.zeros(chunk_size, jnp.int32)])
  lanes = jnp.arange(chunk_size)

  for g, fn in enumerate(fns):

    def chunk(j, out, g=g, fn=fn):
      position = j * chunk_size + lanes
      valid = position < counts[g]
      clients = order[starts[g] + position]
      clients = jnp.where(valid, clients, clients[0])
      results = jax.vmap(fn)(*jax.tree.map(lambda leaf: leaf[clients], stacked_args))
      rows = jnp.where(valid, clients, num_clients)  # out of range: dropped
      return jax.tree.map(lambda o, r: o.at[rows].set(r, mode="drop"), out, results)

    out = jax.lax.fori_loop(0, (counts[g] + chunk_size - 1) // chunk_size, chunk, out)
  return out


def _stage_name(fn) -> str:
  while hasattr(fn, "func"):  # functools.partial
    fn = fn.func
  return getattr(fn, "__qualname__", None) or type(fn).__name__


def _client_loop(fn, stage: str, stacked_args):
  """``fn`` client by client in a Python loop (debug mode); an exception names the client and ``stage``."""
  outputs = []
  for client in range(_num_clients(stacked_args)):
    client_args = jax.tree.map(lambda leaf: leaf[client], stacked_args)  # pylint: disable=cell-var-from-loop
    try:
      outputs.append(fn(*client_args))
    except Exception as e:  # pylint: disable=broad-except -- re-raised with the client and the stage
      raise ClientError(client, stage, e) from e
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outputs)


def _pad_clients(stacked_args, total: int):
  """Extends every leaf's client axis to ``total`` rows by repeating its last client."""

  def pad(leaf):
    extra = total - leaf.shape[0]
    if not extra:
      return leaf
    return jnp.concatenate([leaf, jnp.repeat(leaf[-1:], extra, axis=0)], axis=0)

  return jax.tree.map(pad, stacked_args)


def _pad_rows(tree, shards: int):
  """Extends every leaf's row axis to a multiple of ``shards`` by repeating its last row."""
  rows = jax.tree_util.tree_leaves(tree)[0].shape[0]
  return _pad_clients(tree, -(-rows // shards) * shards)


def for_each_client(fn: Callable[..., Any], *, chunk_size: int | None = None) -> Callable[..., Any]:
  """Lift ``fn(*client_args)`` to stacked arguments with a leading client axis ``M``.

  Args:
    fn: a pure function of one client's arguments (pytrees without the client
      axis). Arrays it captures (closures, ``functools.partial``) are shared by
      all clients -- replicated on every device when clients are sharded. An
      argument passed as a :class:`Shared` reaches ``fn`` whole (not sliced per
      client) and is read with :meth:`Shared.take`: how a client reads its
      neighbours' weights or samples without every device holding all of them.
    chunk_size: ``None`` (default) takes the device policy's chunk size
      (:func:`use_devices`; all at once outside any) when the function is
      traced; ``0`` maps all (local) clients at once (plain ``vmap``; for cheap
      elementwise maps); a positive value maps ``chunk_size`` clients at a time
      per device (``lax.map`` with ``batch_size``), bounding peak memory by the
      chunk instead of ``M``.

  Returns:
    ``mapped(*stacked_args)``: every leaf of every argument has leading axis
    ``M``; outputs are stacked along a leading ``M`` axis. Traced inside
    :func:`use_devices` with several devices, clients are split over them;
    results equal the single-device ones up to float rounding. Inside
    ``use_devices(debug=True)`` clients run one at a time in a Python loop.

  Raises:
    ClientError: in debug mode, ``fn`` raised for a client (named, with ``fn``'s name).
    ValueError: a negative or non-int ``chunk_size`` (at once); arguments
      without a common leading axis (when called).
  """
  return _lift((fn,), chunk_size, grouped=False)


def for_each_client_by_group(
  fns: Sequence[Callable[..., Any]], *, chunk_size: int | None = None
) -> Callable[..., Any]:
  """Lift ``G`` per-client functions: client ``i`` runs ``fns[group[i]]``, ``group`` known only when run.

  For work whose cost depends on a per-client size that varies from round to round (a client's
  neighbour count on an Erdős–Rényi graph): ``fns[g]`` is specialised to the ``g``-th size, and each
  client runs the smallest specialisation that holds it instead of every client running the largest.
  Within each group the clients are mapped ``chunk_size`` at a time (a loop whose trip count is the
  group's size this round, rounded up to whole chunks), and their outputs are written back in client
  order. Every ``fns[g]`` must return the same output structure and shapes, and ``fns[-1]`` must be
  right for every client: where grouping cannot pay -- all clients at once (``chunk_size`` 0 or
  ``>= M``), or one function -- every client runs ``fns[-1]``, exactly :func:`for_each_client` of it.

  Args:
    fns: the per-client functions, one per group, the most general last.
    chunk_size: as :func:`for_each_client`.

  Returns:
    ``mapped(group, *stacked_args)``: ``group`` int ``[M]`` with values in ``[0, G)`` (it is not passed to
    the functions; values outside are clipped); the rest as :func:`for_each_client`. Sharded and
    debug-mode calls group each device's clients, or run each client's own function.
  """
  fns = tuple(fns)
  if not fns or not all(callable(f) for f in fns):
    raise ValueError(
      f"for_each_client_by_group needs a non-empty sequence of functions, got {fns!r}"
    )
  return _lift(fns, chunk_size, grouped=True)


def _lift(fns, chunk_size, *, grouped: bool):
  """:func:`for_each_client` (``grouped=False``, one function) or :func:`for_each_client_by_group`."""
  if chunk_size is not None:
    validation.check_int("chunk_size (None or 0 = all clients at once)", chunk_size, low=0)

  def mapped(*args):
    shared_at = {i: a for i, a in enumerate(args) if isinstance(a, Shared)}
    stacked_args = tuple(a for i, a in enumerate(args) if i not in shared_at)
    num_clients = _num_clients(stacked_args)
    chunk = policy_chunk_size() if chunk_size is None else chunk_size

    def with_shared(shared_trees, fn):
      """``fn`` of the mapped arguments alone, the shared ones (in their places) given whole."""
      views = {i: Shared(tree, shared_at[i].split) for i, tree in zip(shared_at, shared_trees)}
      offset = 1 if grouped else 0  # the group (args[0]) is mapped but not passed on

      def per_client(*client_args):
        it = iter(client_args[offset:])
        return fn(*(views[i] if i in views else next(it) for i in range(offset, len(args))))

      return per_client

    def run(shared_trees, local_args):
      """The chunked map of the local clients (all of them, or one device's)."""
      lifted = tuple(with_shared(shared_trees, fn) for fn in fns)
      if not grouped:
        return _chunked(lifted[0], chunk, local_args)
      return _grouped(lifted, chunk, local_args)

    shared_trees = tuple(a.tree for a in shared_at.values())
    if grouped and 0 in shared_at:
      raise ValueError("for_each_client_by_group: the group (first argument) cannot be Shared")
    if debug_clients():
      lifted = tuple(with_shared(shared_trees, fn) for fn in fns)
      if grouped:  # concrete values here (no jit): each client runs its own group's function
        last = len(fns) - 1
        one = lambda group, *rest: lifted[min(max(int(group), 0), last)](group, *rest)
        out = _client_loop(one, _stage_name(fns[-1]), stacked_args)
      else:
        out = _client_loop(lifted[0], _stage_name(fns[0]), stacked_args)
      chex.assert_tree_shape_prefix(out, (num_clients,))
      return out
    shards = num_client_shards()
    if shards == 1:
      out = run(shared_trees, stacked_args)
      chex.assert_tree_shape_prefix(out, (num_clients,))
      return out
    padded = -(-num_clients // shards) * shards
    # Split shared rows enter as their per-device blocks (padded like the clients, so block d holds the
    # rows of device d's clients); the others are replicated.
    shared_specs = tuple(
      PartitionSpec(CLIENTS) if a.split else PartitionSpec() for a in shared_at.values()
    )
    shared_trees = tuple(
      _pad_rows(t, shards) if a.split else t for t, a in zip(shared_trees, shared_at.values())
    )
    sharded = jax.shard_map(
      lambda shared, *args: run(shared, args),
      mesh=_current_mesh(),
      in_specs=(shared_specs, *(PartitionSpec(CLIENTS),) * len(stacked_args)),
      out_specs=PartitionSpec(CLIENTS),
      axis_names=frozenset({CLIENTS}),
      # No replication (vma) checking: per-client code carries loops whose initial values are
      # device-invariant constants but whose updates vary by client (e.g. scan carries in the
      # evolution); every output here is per-client and stacked, so there is nothing to check.
      check_vma=False,
    )
    out = sharded(shared_trees, *_pad_clients(stacked_args, padded))
    if padded != num_clients:
      out = jax.tree.map(lambda leaf: leaf[:num_clients], out)
    chex.assert_tree_shape_prefix(out, (num_clients,))
    return out

  return mapped
