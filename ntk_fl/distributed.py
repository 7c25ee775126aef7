"""One experiment over several JAX processes (hosts): start-up, a local launcher, host-side helpers.

JAX's multi-controller model: every process runs the same program; after
:func:`initialize`, ``jax.devices()`` lists every process's devices, the
``'clients'`` mesh of :mod:`ntk_fl.parallel` spans them all, and each process
computes (and keeps) the clients that fall on its own devices. Collectives between
processes are XLA's (gloo on CPU, NCCL on GPU); there is no messaging of our own.

* :func:`initialize` -- ``jax.distributed.initialize`` with CPU collectives
  switched to gloo. Without arguments JAX finds the coordinator, process count and
  id in a SLURM / Open MPI / Kubernetes environment (or ``JAX_COORDINATOR_ADDRESS``
  with explicit counts).
* :func:`launch_local` -- ``P`` copies of a command on this machine with the
  coordinator on localhost (what ``--num_processes=P`` runs): each process stands in
  for a host. If one dies the others are stopped and its exit status returned.
  :class:`ConsoleRelay` shows the user process 0's console output only, and none
  once a process was killed (the survivors' reports of the lost peer are kept).
* :func:`is_primary`, :func:`barrier`, :func:`to_host`,
  :func:`client_shardings` -- what the runner needs to write files once, keep the
  processes in step, read sharded results and place client-stacked state.

What runs where: the clients' models and per-client state are sharded over the
processes (a process holds only its own clients'), and so are the training
samples (:func:`place_federation`: each device holds one block with the samples
of its own clients, once each). What every process holds whole is small: every
client's index list (a few bytes per sample, so that any process can say where
a neighbour's samples are) and the test set. A decentralized method's
neighbourhoods cross process boundaries and change every round; the rows a chunk
of clients needs from other devices (neighbours' samples and weights) are
fetched inside the step by XLA collectives (:class:`ntk_fl.parallel.Shared`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

# The mesh axis's name from the leaf: this module needs it, not the client map of ``parallel``.
from ntk_fl._src.names import CLIENTS

__all__ = [
  "initialize",
  "shutdown",
  "launch_local",
  "ConsoleRelay",
  "is_primary",
  "barrier",
  "to_host",
  "client_shardings",
  "free_port",
  "place_federation",
]


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> None:
  """Joins this process to a multi-process JAX run (before any JAX computation).

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator service; ``None``
      lets JAX detect it (SLURM, Open MPI, ...; or ``JAX_COORDINATOR_ADDRESS``).
    num_processes, process_id: the run's process count and this process's rank;
      ``None`` lets JAX detect them.
  """
  # CPU devices of different processes talk through gloo (the default CPU client has no
  # cross-process collectives); GPU/TPU backends ignore this option.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )


def shutdown() -> None:
  """Leaves the multi-process run together with the others (no-op in a one-process run).

  Every process calling it before exiting avoids the stragglers waiting out JAX's
  shutdown timeout for a coordinator that has already gone.
  """
  if jax.process_count() > 1:
    jax.distributed.shutdown()


def free_port() -> int:
  """A TCP port on localhost that was free a moment ago (for a local coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _parent_death_signal():
  """The C library's ``prctl``, looked up in the parent (never in a forked child); ``None`` if absent."""
  try:
    import ctypes  # pylint: disable=import-outside-toplevel

    return ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):  # not Linux: the launcher's finally still stops its processes
    return None


class ConsoleRelay:
  """The console (stderr) output of a local multi-process run's processes, as the user should see it.

  Process 0 speaks for the run (progress bar, warnings, its error line): its
  output is shown, each chunk ``hold_seconds`` after it was read, unless by then
  a process of the run has been killed by a signal or :meth:`mute` was called
  (the launcher stops the run and prints its own line). The other processes
  repeat process 0 or report a lost peer, so their output is only kept. Kept
  output (the last ``keep_bytes`` of each process) is read with :meth:`kept`.

  The hold is what keeps the survivors' own errors about a killed peer off the
  console: the kernel reaps a killed process (its status is visible to the
  launcher) within a moment of closing its sockets, long before a survivor has
  noticed the loss and written a report.
  """

  def __init__(self, console=None, *, hold_seconds: float = 0.3, keep_bytes: int = 1 << 20):
    self._console = console
    self._hold = hold_seconds
    self._keep_bytes = keep_bytes
    self._kept: dict[int, bytearray] = {}
    self._muted = threading.Event()
    self._lock = threading.Lock()
    self._threads: list[threading.Thread] = []
    self._procs: list[subprocess.Popen] = []
    self.failed: tuple[int, int] | None = (
      None  # (rank, status) of the failure launch_local reported
    )

  def start(self, procs: Sequence[subprocess.Popen]) -> None:
    """Starts reading the processes' ``stderr`` pipes (one thread each)."""
    self._procs = list(procs)
    for rank, proc in enumerate(self._procs):
      thread = threading.Thread(
        target=self._pump, args=(rank, proc.stderr), name=f"ntk_fl-stderr-{rank}", daemon=True
      )
      thread.start()
      self._threads.append(thread)

  def mute(self) -> None:
    """From now on nothing is shown; everything is kept."""
    self._muted.set()

  def killed(self) -> bool:
    """Whether a process of the run has been killed by a signal."""
    return any((p.poll() or 0) < 0 for p in self._procs)

  def close(self, timeout: float = 10.0) -> None:
    """Waits until the processes' pipes are drained (they have exited)."""
    deadline = time.monotonic() + timeout
    for thread in self._threads:
      thread.join(max(deadline - time.monotonic(), 0.0))

  def kept(self, rank: int) -> str:
    with self._lock:
      return bytes(self._kept.get(rank, b"")).decode(errors="replace")

  def _pump(self, rank: int, pipe) -> None:
    console = self._console or sys.stderr.buffer
    while chunk := os.read(pipe.fileno(), 1 << 16):
      if rank == 0 and not self._muted.is_set():
        time.sleep(self._hold)
        if not (self._muted.is_set() or self.killed()):
          try:
            console.write(chunk)
            console.flush()
          except (OSError, ValueError):  # the console went away: keep the rest
            pass
          else:
            continue
      with self._lock:
        kept = self._kept.setdefault(rank, bytearray())
        kept += chunk
        del kept[: max(len(kept) - self._keep_bytes, 0)]
    pipe.close()


def launch_local(
  command: Sequence[str],
  num_processes: int,
  *,
  env: dict | None = None,
  poll_seconds: float = 0.2,
  pass_fds: Sequence[int] = (),
  relay: ConsoleRelay | None = None,
) -> int:
  """Runs ``num_processes`` copies of ``command`` on this machine as one multi-process JAX run.

  Process ``i`` gets ``--process_id=i --num_processes=P --coordinator_address=localhost:PORT``
  appended (the flags of ``experiments/main.py``) and inherits stdout and stderr,
  or, with ``relay``, sends its stderr through it (see :class:`ConsoleRelay`).

  Returns:
    ``0`` when every process succeeded; otherwise the exit status of the process
    that failed (negative: killed by that signal; a killed process is reported
    before one that failed on its own, then the lowest rank), after stopping the
    others (they would wait for it in a collective until JAX's heartbeat timeout).
    With ``relay``, ``relay.failed`` is ``(rank, status)`` of that process.

  The processes die with the launcher, even one killed by SIGKILL (a parent-death
  signal, Linux), so none is left writing the workdir; ``pass_fds`` are inherited
  (the workdir lock, :func:`ntk_fl.rundir.lock_for_children`).
  """
  if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
  address = f"localhost:{free_port()}"
  launcher, prctl = os.getpid(), _parent_death_signal()

  def start_child():  # in the child, before exec: only a C call and a check (fork-safe)
    if prctl is not None:
      prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the launcher dies
    if os.getppid() != launcher:  # the launcher died before the signal was armed
      os._exit(1)  # pylint: disable=protected-access

  # A launcher stopped by SIGTERM (a job scheduler, a test) stops its processes too (via the finally below).
  previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  procs = [
    subprocess.Popen(
      [
        *command,
        f"--process_id={i}",
        f"--num_processes={num_processes}",
        f"--coordinator_address={address}",
      ],
      env=env,
      pass_fds=tuple(pass_fds),
      preexec_fn=start_child,
      stderr=subprocess.PIPE if relay is not None else None,
    )
    for i in range(num_processes)
  ]
  if relay is not None:
    relay.start(procs)
  failures: list[tuple[int, int]] = []
  try:
    while True:
      status = [p.poll() for p in procs]  # every process polled each time (no short circuit)
      failures = [(rank, rc) for rank, rc in enumerate(status) if rc not in (None, 0)]
      if failures or None not in status:
        break
      time.sleep(poll_seconds)
    failed = min(failures, key=lambda f: (f[1] > 0, f[0])) if failures else None
    if relay is not None:
      relay.failed = failed
      # Process 0's own error line is its report; any other failure is the launcher's to report.
      if failed is not None and (failed[0] != 0 or failed[1] < 0):
        relay.mute()
  except BaseException:
    if relay is not None:  # Ctrl-C, SIGTERM: the launcher says what happened
      relay.mute()
    raise
  finally:
    _stop(procs)
    signal.signal(signal.SIGTERM, previous)
    if relay is not None:
      relay.close()
  return failed[1] if failed else 0


def _stop(procs: list[subprocess.Popen], grace_seconds: float = 10.0) -> None:
  """SIGTERM, then SIGKILL after ``grace_seconds``, for each launched process still running."""
  running = [p for p in procs if p.poll() is None]
  for p in running:
    p.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace_seconds
  for p in running:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def is_primary() -> bool:
  """Whether this is process 0, the one that writes files and logs."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reached the barrier ``name`` (no-op in a one-process run)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def to_host(tree: Any) -> Any:
  """``tree``'s arrays as numpy, gathered from every process when they are sharded across processes."""
  if jax.process_count() == 1:
    return jax.device_get(tree)

  def fetch(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x) if isinstance(x, jax.Array) else x

  return jax.tree.map(fetch, tree)


def process_allgather_ints(value: int) -> list[int]:
  """Every process's ``value``, in process order (``[value]`` in a one-process run)."""
  if jax.process_count() == 1:
    return [int(value)]
  return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int64(value))).ravel()]


def client_shardings(shapes: Any, num_clients: int, mesh) -> Any:
  """Per-leaf shardings for a client-stacked state on ``mesh`` (``None`` = single device).

  Leaves whose leading axis is ``num_clients`` (and divides evenly over the mesh) are split
  over the ``'clients'`` axis; everything else (scalars, the server's model) is replicated.
  """
  if mesh is None:
    return None

  size = mesh.shape[CLIENTS]

  def sharding(leaf):
    split = leaf.ndim >= 1 and leaf.shape[0] == num_clients and num_clients % size == 0
    return NamedSharding(mesh, PartitionSpec(CLIENTS) if split else PartitionSpec())

  return jax.tree.map(sharding, shapes)


def place_federation(
  x: np.ndarray, y: np.ndarray, client_indices, mesh, *, n_max: int | None = None
):
  """A :class:`ntk_fl.data.Federation` whose samples are split over ``mesh``'s devices, one block each.

  Device ``d`` gets the samples of the clients :func:`ntk_fl.parallel.for_each_client`
  gives it (:func:`ntk_fl.data.federation.block_layout`), and a process builds
  only the blocks of its own devices: ``x`` is read at those rows only, so after
  this call the process holds its clients' samples and nothing of the others'
  (``x`` may be anything indexable by row arrays -- a numpy array, a memmap, the
  :class:`ntk_fl.data.sources.LazyFeatures` a multi-process run loads -- and
  the caller drops it).

  Args:
    x: ``[N, *feature_shape]`` training inputs with ``shape`` and row indexing
      (only the rows of this process's clients are read).
    y: ``[N]`` integer labels.
    client_indices: ``M`` index arrays into ``x``/``y``.
    mesh: the ``'clients'`` mesh (:func:`ntk_fl.parallel.make_client_mesh`).
    n_max: as in :func:`ntk_fl.data.make_federation`.

  Returns:
    A ``Federation`` with ``samples_x`` ``[D * B, ...]`` and ``samples_y`` ``[D * B]``
    as jax arrays sharded ``P('clients')`` over the ``D`` devices (``B`` rows per
    block), and ``index``, ``mask``, ``n`` as numpy arrays (global row numbers;
    the same in every process).
  """
  from ntk_fl.data import federation as federation_lib  # pylint: disable=g-import-not-at-top

  y = federation_lib.check_samples(x, y)
  num_blocks = int(mesh.shape[CLIENTS])
  layout = federation_lib.block_layout(client_indices, x.shape[0], num_blocks, n_max=n_max)
  sharding = NamedSharding(mesh, PartitionSpec(CLIENTS))
  size = layout.block_size
  blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def block(index, which: int) -> np.ndarray:
    start = index[0].start or 0
    if start % size:
      raise AssertionError(
        f"a device's slice starts at row {start}, not at a block boundary (block size {size})"
      )
    b = start // size
    if b not in blocks:
      blocks[b] = layout.block_samples(x, y, b)
    return blocks[b][which]

  samples_x = jax.make_array_from_callback(
    (num_blocks * size, *x.shape[1:]), sharding, lambda i: block(i, 0)
  )
  samples_y = jax.make_array_from_callback((num_blocks * size,), sharding, lambda i: block(i, 1))
  return federation_lib.Federation(
    samples_x=samples_x, samples_y=samples_y, index=layout.index, mask=layout.mask, n=layout.n
  )


def strip_flags(argv: Sequence[str], names: Sequence[str]) -> list[str]:
  """``argv`` without ``--name=value`` / ``--name value`` occurrences of the given flag names."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
      continue
    name = arg.split("=", 1)[0].lstrip("-")
    if arg.startswith("--") and name in names:
      skip = "=" not in arg
      continue
    out.append(arg)
  return out


def python_command(script: str, argv: Sequence[str]) -> list[str]:
  """The command that runs ``script`` with ``argv`` under this interpreter."""
  return [sys.executable, os.path.abspath(script), *argv]
