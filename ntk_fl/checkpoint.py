"""Round checkpoints of an algorithm state with orbax-checkpoint, verified and recoverable.

A checkpoint is the state pytree saved under ``<directory>/<rounds_done>``
(the orbax step is the number of completed rounds). Orbax writes each
checkpoint into a ``<step>.orbax-checkpoint-tmp-*`` directory and renames it
into place only when every file is written, so a process killed mid-save
leaves a temporary directory that is never listed as a step (orbax removes it
on the next start). A step directory also needs orbax's
``_CHECKPOINT_METADATA`` file to count as finalised.

Every checkpoint records a SHA-256 digest of its arrays in orbax's step
metadata (``custom_metadata["ntk_fl"]["digest"]``, written inside the same
atomic rename), tied to its run: the digest covers the run's identity (a hash
of its config, seed included; ``Checkpoints(identity=...)``), recorded beside
it as ``"run"``. A restore recomputes it, so damage that still decodes -- a
flipped byte, a zero-filled block inside a data file, another checkpoint's
arrays -- is caught as surely as a truncated file, which TensorStore refuses
to read, and so is a checkpoint copied from another run. Metadata that is
unreadable or records no digest is damage too: the check is never skipped.
Arrays spread over several processes are digested as the whole arrays they
form (gathered one leaf at a time), so a multi-process checkpoint carries the
same digest a one-process run of the same state would, and any process count
can verify it.

Recovery (:meth:`Checkpoints.recover`): step directories that are incomplete
(no metadata file) or unreadable / failing their digest are *set aside* --
renamed to ``<step>.set-aside-<why>-<UTC time>``, which orbax does not list
and never deletes -- with a warning naming each, and the newest good
checkpoint is returned. Nothing is deleted: a set-aside directory can be
inspected or moved back by hand.

Typed PRNG keys (``jax.random.key``) are stored as their raw key data and
re-wrapped on restore, so states may hold either key flavour.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from typing import Any
from collections.abc import Sequence

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["CheckpointDamaged", "Checkpoints", "SET_ASIDE_MARK"]

_METADATA_FILE = "_CHECKPOINT_METADATA"
_CUSTOM_KEY = "ntk_fl"
#: Part of the name of a set-aside checkpoint directory: ``<step>.set-aside-<why>-<UTC time>``.
SET_ASIDE_MARK = ".set-aside-"


class CheckpointDamaged(RuntimeError):
  """A checkpoint that cannot be restored as written: incomplete, unreadable or failing its digest."""

  def __init__(self, path: str, why: str):
    super().__init__(f"checkpoint {path} is damaged: {why}")
    self.path = path
    self.why = why


def _is_typed_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_storable(tree):
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, tree)


def _from_storable(restored, template):
  return jax.tree.map(
    lambda r, t: (
      jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_typed_key(t) else r
    ),
    restored,
    template,
  )


def _whole(leaf) -> np.ndarray:
  """A leaf as one host array; gathered from every process when it lives partly on others."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    # A collective: every process digests the same leaves in the same (tree) order.
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
  return np.asarray(jax.device_get(leaf))


def state_digest(storable) -> str:
  """SHA-256 over the leaves of a (key-data) state: each leaf's dtype, shape and bytes.

  Leaf digests are sorted before they are combined, so a template-free restore
  (dicts) and a templated one (NamedTuples) of the same checkpoint agree. A leaf
  spread over several processes is gathered (one leaf at a time, so a process
  holds at most one whole leaf beyond its own shards) and hashed whole: the
  digest does not depend on how the state is placed, and in a multi-process run
  every process must call this together.
  """
  parts = []
  for leaf in jax.tree_util.tree_leaves(storable):
    array = np.ascontiguousarray(_whole(leaf))
    h = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    h.update(array.reshape(-1).view(np.uint8) if array.size else b"")
    parts.append(h.hexdigest())
  return hashlib.sha256("".join(sorted(parts)).encode()).hexdigest()


def _tied(digest: str, identity: str) -> str:
  """A state digest tied to its run: SHA-256 of the run's identity (config hash) and the digest."""
  return hashlib.sha256(f"{identity}:{digest}".encode()).hexdigest()


def _first_line(err: BaseException) -> str:
  """The gist of an orbax/TensorStore error (theirs run to a hundred lines)."""
  text = str(err).strip().splitlines()
  line = text[0].split(" See full TensorStore details")[0] if text else ""
  return f"{type(err).__name__}: {line[:300]}"


class Checkpoints:
  """Synchronous orbax checkpoints of a state pytree, keyed by completed rounds.

  Args:
    directory: where step directories live (created if missing).
    max_to_keep: how many most recent checkpoints to keep (older ones deleted).
    keep: round counts whose checkpoints are never deleted.
    read_only: only list and restore (another run's checkpoints, e.g. the source
      of a branch, possibly still running): nothing is created, saved, set aside
      or cleaned up.
    identity: the run's identity (:func:`ntk_fl.rundir.run_identity`: a hash of its
      config, seed included). Saved checkpoints record it and their digest covers
      it; a checkpoint whose recorded identity differs is damaged (a checkpoint
      copied from another run). ``None``: a reader that takes the recorded
      identity as given (the arrays are still checked against the digest).
    also_accept: further identities a checkpoint may record and still belong to this run: a
      resumed (or branched-from) run's identity as its ``config.json`` was written, by a version of the
      package whose schema lacked keys added since or still counted the checkpoint cadence as part of
      the run (:func:`ntk_fl.rundir.written_identities`). Saves record ``identity``.
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    max_to_keep: int = 2,
    keep: Sequence[int] = (),
    read_only: bool = False,
    identity: str | None = None,
    also_accept: Sequence[str | None] = (),
  ):
    self.directory = os.path.abspath(os.fspath(directory))
    self.read_only = read_only
    self.identity = identity
    self.also_accept = tuple(a for a in also_accept if a and a != identity)
    preserve = ocp.checkpoint_managers
    policy = preserve.LatestN(n=max_to_keep)
    if keep:
      policy = preserve.AnyPreservationPolicy(
        [policy, preserve.CustomSteps(steps=[int(k) for k in keep])]
      )
    # Synchronous saves: the runner checkpoints between rounds and must know the
    # checkpoint is final before it moves on (and before a test kills the run).
    options = ocp.CheckpointManagerOptions(
      preservation_policy=policy,
      enable_async_checkpointing=False,
      create=not read_only,
      cleanup_tmp_directories=not read_only,
      read_only=read_only,
      # Read-only managers never save; saying so keeps orbax from logging that it reset the interval.
      save_interval_steps=0 if read_only else 1,
    )
    # The handler of the one item saved (``StandardSave``), named up front: a manager that only learns
    # it from a ``save`` or ``restore`` call logs a warning on every ``metadata()`` of a resume.
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
    )

  def path(self, rounds_done: int) -> str:
    return os.path.join(self.directory, str(rounds_done))

  def save(self, rounds_done: int, state) -> None:
    """Saves ``state`` as the checkpoint after ``rounds_done`` rounds (blocks until final)."""
    storable = _to_storable(state)
    digest = state_digest(storable)
    run = self.identity or ""
    # ``processes``: how many processes wrote it (informational; the digest is of the whole arrays).
    record = {"digest": _tied(digest, run), "run": run, "processes": jax.process_count()}
    self._manager.save(
      rounds_done,
      args=ocp.args.StandardSave(storable),
      force=True,
      custom_metadata={_CUSTOM_KEY: record},
    )
    self._manager.wait_until_finished()

  def _listed_steps(self) -> list[int]:
    self._manager.reload()  # another process may have written since this manager was made
    return sorted(self._manager.all_steps())

  def steps(self) -> list[int]:
    """Completed-round indices of the finalised checkpoints (metadata file present), ascending."""
    return [
      s for s in self._listed_steps() if os.path.isfile(os.path.join(self.path(s), _METADATA_FILE))
    ]

  def incomplete_steps(self) -> list[int]:
    """Step directories orbax lists that lack their metadata file (an interrupted copy, a deleted file)."""
    return sorted(set(self._listed_steps()) - set(self.steps()))

  def latest(self) -> int | None:
    """The most recent finalised checkpoint's round count, or ``None`` (not verified: see :meth:`recover`)."""
    steps = self.steps()
    return steps[-1] if steps else None

  def _record(self, rounds_done: int) -> dict:
    """The ``ntk_fl`` record of a checkpoint's metadata; damaged when unreadable or digest-less."""
    path = self.path(rounds_done)
    try:
      custom = self._manager.metadata(rounds_done).custom_metadata
    except Exception as err:  # orbax raises JSON, OSError, ... for a damaged metadata file
      raise CheckpointDamaged(
        path, f"its {_METADATA_FILE} is unreadable ({_first_line(err)})"
      ) from err
    record = (custom or {}).get(_CUSTOM_KEY) if isinstance(custom, dict) else None
    if not (isinstance(record, dict) and isinstance(record.get("digest"), str)):
      raise CheckpointDamaged(
        path,
        f"its {_METADATA_FILE} records no digest (unreadable, emptied, or not written by this "
        "version of ntk_fl)",
      )
    return record

  def _check_digest(self, rounds_done: int, storable) -> None:
    record = self._record(rounds_done)
    if "run" not in record:
      self._check_untied_digest(rounds_done, record, storable)
      return
    recorded = str(record.get("run", ""))
    # Without an identity (an analysis script reading a run's checkpoints) the recorded one is
    # taken as given.
    identity = self.identity if self.identity is not None else recorded
    if recorded in self.also_accept:
      identity = recorded
    digest = state_digest(storable)
    if _tied(digest, identity) != record["digest"]:
      if recorded != identity:
        raise CheckpointDamaged(
          self.path(rounds_done), "it was written by a different run (another config or seed)"
        )
      raise CheckpointDamaged(
        self.path(rounds_done),
        "its arrays do not match the digest recorded "
        "when it was written (a data file was changed after the save)",
      )

  def _check_untied_digest(self, rounds_done: int, record: dict, storable) -> None:
    """A checkpoint from before checkpoints recorded their run: its digest is of the arrays alone, so the
    arrays are checked and the run is not (the resume has checked the run's ``config.json``)."""
    if state_digest(storable) != record["digest"]:
      raise CheckpointDamaged(
        self.path(rounds_done),
        "its arrays do not match the digest recorded when it was written (a data file was changed "
        "after the save)",
      )
    logging.warning(
      "checkpoint %s was written before checkpoints recorded their run: its arrays are verified, "
      "its run is taken from the workdir",
      self.path(rounds_done),
    )

  def verify(self, rounds_done: int) -> None:
    """Restores checkpoint ``rounds_done`` without a template and checks its digest.

    Raises:
      CheckpointDamaged: the checkpoint is incomplete, unreadable or fails its digest.
    """
    self.read(rounds_done)

  def read(self, rounds_done: int) -> Any:
    """Checkpoint ``rounds_done`` as stored (NumPy arrays in nested dicts and lists, typed PRNG keys
    as their raw data), its digest checked: for reading a run's state without building its template.

    Raises:
      CheckpointDamaged: the checkpoint is incomplete, unreadable or fails its digest.
    """
    path = self.path(rounds_done)
    if not os.path.isfile(os.path.join(path, _METADATA_FILE)):
      raise CheckpointDamaged(path, f"incomplete: no {_METADATA_FILE} file")
    self._record(rounds_done)  # first: an unreadable record is damage, not a skipped check
    try:
      restored = self._manager.restore(rounds_done, args=ocp.args.StandardRestore())
    except Exception as err:  # orbax/TensorStore raise many types (JSON, DATA_LOSS, OSError, ...)
      raise CheckpointDamaged(path, f"unreadable ({_first_line(err)})") from err
    self._check_digest(rounds_done, restored)
    return restored

  def restore(self, rounds_done: int, template) -> Any:
    """Restores the checkpoint ``rounds_done`` into the structure/dtypes of ``template``.

    Raises:
      FileNotFoundError: no finalised checkpoint ``rounds_done``.
      CheckpointDamaged: its arrays fail the digest recorded when it was written.
    """
    if rounds_done not in self.steps():
      raise FileNotFoundError(
        f"no finalised checkpoint for round {rounds_done} in {self.directory}; have {self.steps()}"
      )
    restored = self._manager.restore(
      rounds_done, args=ocp.args.StandardRestore(_to_storable(template))
    )
    self._check_digest(rounds_done, restored)
    return _from_storable(restored, template)

  def set_aside(self, rounds_done: int, why: str) -> str:
    """Renames step directory ``rounds_done`` out of orbax's view (never deleted); returns the new path."""
    if self.read_only:
      raise PermissionError(
        f"cannot set aside {self.path(rounds_done)}: these checkpoints are opened read-only"
      )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    target = f"{self.path(rounds_done)}{SET_ASIDE_MARK}{why}-{stamp}"
    if jax.process_index() == 0:
      os.rename(self.path(rounds_done), target)
    if jax.process_count() > 1:
      # The same name in every process (each has its own clock: the stamp may differ).
      ocp.multihost.sync_global_processes(f"ntk_fl_set_aside_{rounds_done}_{why}")
    self._manager.reload()
    return target

  def good_steps(self) -> tuple[list[int], dict[int, str]]:
    """Finalised checkpoints that verify, and ``{step: why}`` of those that do not (read-only; nothing renamed)."""
    good, damaged = [], {}
    for step in self.steps():
      try:
        self.verify(step)
        good.append(step)
      except CheckpointDamaged as err:
        damaged[step] = err.why
    for step in self.incomplete_steps():
      damaged[step] = f"incomplete: no {_METADATA_FILE} file"
    return good, damaged

  def recover(self, upto: int | None = None) -> int | None:
    """Sets damaged checkpoints aside and returns the newest good one (``None``: none left).

    Incomplete step directories are set aside (``...set-aside-incomplete-...``);
    then, newest first, each finalised checkpoint is verified until one passes,
    the failures set aside (``...set-aside-damaged-...``), each with a warning
    naming it. With ``upto``, checkpoints after round ``upto`` are set aside first
    (``...set-aside-superseded-...``: the resumed run recomputes those rounds), and
    ``upto`` itself must be good (else :class:`CheckpointDamaged` /
    ``FileNotFoundError``).
    """
    for step in self.incomplete_steps():
      target = self.set_aside(step, "incomplete")
      logging.warning(
        "checkpoint %s is incomplete (no %s file); set aside as %s",
        self.path(step),
        _METADATA_FILE,
        target,
      )
    if upto is not None:
      if upto not in self.steps():
        raise FileNotFoundError(
          f"no finalised checkpoint after round {upto} in {self.directory}; "
          f"checkpoints after rounds {self.steps()}"
        )
      self.verify(upto)
      for step in [s for s in self.steps() if s > upto]:
        target = self.set_aside(step, "superseded")
        logging.warning(
          "resuming from round %d: checkpoint %s set aside as %s", upto, self.path(step), target
        )
      return upto
    for step in reversed(self.steps()):
      try:
        self.verify(step)
        return step
      except CheckpointDamaged as err:
        target = self.set_aside(step, "damaged")
        logging.warning("%s; set aside as %s", err, target)
    return None

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> Checkpoints:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
