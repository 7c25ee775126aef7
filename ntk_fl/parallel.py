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
  array the function *captures* (closure constants, e.g. the whole federation's
  data that NTK-DFL gathers neighbours from) is replicated, and the outputs come
  back stacked ``P('clients')``. ``M`` need not divide the device count: the
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
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from ntk_fl import validation

__all__ = ["CLIENTS", "for_each_client", "make_client_mesh", "use_devices", "num_client_shards", "current_mesh",
           "policy_chunk_size"]

CLIENTS = "clients"
"""Name of the mesh axis the client axis is sharded over."""

_STATE = threading.local()   # .policies: the stack of use_devices (mesh or None = single device, chunk_size)


def _current_policy() -> tuple[Mesh | None, int]:
  policies = getattr(_STATE, "policies", None)
  return policies[-1] if policies else (None, 0)


def _current_mesh() -> Mesh | None:
  return _current_policy()[0]


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
      raise ValueError(f"devices = {count} but only {len(available)} {available[0].platform} device(s) exist; "
                       f"use 0 for all of them or a number in [1, {len(available)}]")
    chosen = available[:count or len(available)]
  # Auto (not Explicit) axes: XLA's partitioner places the rest of the step around the shard_map.
  return Mesh(np.asarray(chosen), (CLIENTS,), axis_types=(AxisType.Auto,))


@contextlib.contextmanager
def use_devices(devices: int | Sequence[jax.Device] = 0, *, chunk_size: int = 0) -> Iterator[Mesh | None]:
  """The device policy: every :func:`for_each_client` *traced* inside shards clients over ``devices``.

  Args:
    devices: as in :func:`make_client_mesh`. ``1`` (or ``0`` on a one-device
      machine) is the single-device path: no mesh.
    chunk_size: clients per ``vmap`` chunk on each device for every
      :func:`for_each_client` that does not name its own (``0`` = all at once).

  Yields:
    The mesh, or ``None`` on the single-device path.

  Contexts nest (the innermost wins) and are per thread.
  """
  chunk_size = validation.check_int("chunk_size (0 = all clients at once)", chunk_size, low=0)
  mesh = make_client_mesh(devices)
  if not hasattr(_STATE, "policies"):
    _STATE.policies = []
  _STATE.policies.append((mesh if mesh.size > 1 else None, chunk_size))
  try:
    yield _STATE.policies[-1][0]
  finally:
    _STATE.policies.pop()


def num_client_shards() -> int:
  """Devices :func:`for_each_client` splits clients over at this point of tracing (``1`` = unsharded)."""
  mesh = _current_mesh()
  if mesh is None or CLIENTS in jax.sharding.get_abstract_mesh().manual_axes:
    return 1
  return int(mesh.shape[CLIENTS])


def _num_clients(stacked_args) -> int:
  leaves = jax.tree_util.tree_leaves(stacked_args)
  if not leaves:
    raise ValueError("for_each_client needs at least one array argument with a client axis")
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    shapes = sorted({str(np.shape(leaf)) for leaf in leaves})
    raise ValueError("every argument leaf of a for_each_client function needs the same leading client axis M; "
                     f"got leaf shapes {shapes}")
  return sizes.pop()


def _chunked(fn, chunk_size, stacked_args):
  """``fn`` over the leading axis of ``stacked_args``, ``chunk_size`` clients at a time."""
  num_clients = _num_clients(stacked_args)
  if not chunk_size or chunk_size >= num_clients:
    return jax.vmap(fn)(*stacked_args)
  return jax.lax.map(lambda args: fn(*args), stacked_args, batch_size=chunk_size)


def _pad_clients(stacked_args, total: int):
  """Extends every leaf's client axis to ``total`` rows by repeating its last client."""
  def pad(leaf):
    extra = total - leaf.shape[0]
    if not extra:
      return leaf
    return jnp.concatenate([leaf, jnp.repeat(leaf[-1:], extra, axis=0)], axis=0)
  return jax.tree.map(pad, stacked_args)


def for_each_client(fn: Callable[..., Any], *, chunk_size: int | None = None) -> Callable[..., Any]:
  """Lift ``fn(*client_args)`` to stacked arguments with a leading client axis ``M``.

  Args:
    fn: a pure function of one client's arguments (pytrees without the client
      axis). Arrays it captures (closures, ``functools.partial``) are shared by
      all clients -- replicated on every device when clients are sharded.
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
    results equal the single-device ones up to float rounding.

  Raises:
    ValueError: a negative or non-int ``chunk_size`` (at once); arguments
      without a common leading axis (when called).
  """
  if chunk_size is not None:
    validation.check_int("chunk_size (None or 0 = all clients at once)", chunk_size, low=0)

  def mapped(*stacked_args):
    num_clients = _num_clients(stacked_args)
    chunk = policy_chunk_size() if chunk_size is None else chunk_size
    shards = num_client_shards()
    if shards == 1:
      out = _chunked(fn, chunk, stacked_args)
      chex.assert_tree_shape_prefix(out, (num_clients,))
      return out
    padded = -(-num_clients // shards) * shards
    sharded = jax.shard_map(
        lambda *args: _chunked(fn, chunk, args),
        mesh=_current_mesh(), in_specs=PartitionSpec(CLIENTS), out_specs=PartitionSpec(CLIENTS),
        axis_names=frozenset({CLIENTS}),
        # No replication (vma) checking: per-client code carries loops whose initial values are
        # device-invariant constants but whose updates vary by client (e.g. scan carries in the
        # evolution); every output here is per-client and stacked, so there is nothing to check.
        check_vma=False)
    out = sharded(*_pad_clients(stacked_args, padded))
    if padded != num_clients:
      out = jax.tree.map(lambda leaf: leaf[:num_clients], out)
    chex.assert_tree_shape_prefix(out, (num_clients,))
    return out

  return mapped
