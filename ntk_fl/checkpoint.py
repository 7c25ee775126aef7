"""Round checkpoints of an algorithm state with orbax-checkpoint.

A checkpoint is the state pytree saved under ``<directory>/<rounds_done>``
(the orbax step is the number of completed rounds). Orbax writes each
checkpoint into a ``<step>.orbax-checkpoint-tmp-*`` directory and renames it
into place only when every file is written, so a process killed mid-save
leaves a temporary directory that is never listed as a step. As a second
guard, :meth:`Checkpoints.latest` only accepts step directories that also hold
orbax's ``_CHECKPOINT_METADATA`` file (a bare ``<step>`` directory, e.g. from
an interrupted copy, is ignored rather than half-restored).

Typed PRNG keys (``jax.random.key``) are stored as their raw key data and
re-wrapped on restore, so states may hold either key flavour.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpoints"]

_METADATA_FILE = "_CHECKPOINT_METADATA"


def _is_typed_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_storable(tree):
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, tree)


def _from_storable(restored, template):
  return jax.tree.map(
      lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_typed_key(t) else r,
      restored, template)


class Checkpoints:
  """Synchronous orbax checkpoints of a state pytree, keyed by completed rounds.

  Args:
    directory: where step directories live (created if missing).
    max_to_keep: how many most recent checkpoints to keep (older ones deleted).
    keep: round counts whose checkpoints are never deleted.
    read_only: only list and restore (another run's checkpoints, e.g. the source
      of a branch, possibly still running): nothing is created, saved or cleaned up.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2, keep: Sequence[int] = (),
               read_only: bool = False):
    self.directory = os.path.abspath(os.fspath(directory))
    preserve = ocp.checkpoint_managers
    policy = preserve.LatestN(n=max_to_keep)
    if keep:
      policy = preserve.AnyPreservationPolicy([policy, preserve.CustomSteps(steps=[int(k) for k in keep])])
    # Synchronous saves: the runner checkpoints between rounds and must know the
    # checkpoint is final before it moves on (and before a test kills the run).
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=False, create=not read_only,
        cleanup_tmp_directories=not read_only, read_only=read_only)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, rounds_done: int, state) -> None:
    """Saves ``state`` as the checkpoint after ``rounds_done`` rounds (blocks until final)."""
    self._manager.save(rounds_done, args=ocp.args.StandardSave(_to_storable(state)), force=True)
    self._manager.wait_until_finished()

  def steps(self) -> list[int]:
    """Completed-round indices of the finalised checkpoints, ascending."""
    self._manager.reload()  # another process may have written since this manager was made
    return sorted(
        s for s in self._manager.all_steps()
        if os.path.isfile(os.path.join(self.directory, str(s), _METADATA_FILE)))

  def latest(self) -> int | None:
    """The most recent finalised checkpoint's round count, or ``None``."""
    steps = self.steps()
    return steps[-1] if steps else None

  def restore(self, rounds_done: int, template) -> Any:
    """Restores the checkpoint ``rounds_done`` into the structure/dtypes of ``template``."""
    if rounds_done not in self.steps():
      raise FileNotFoundError(
          f"no finalised checkpoint for round {rounds_done} in {self.directory}; have {self.steps()}")
    restored = self._manager.restore(
        rounds_done, args=ocp.args.StandardRestore(_to_storable(template)))
    return _from_storable(restored, template)

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> Checkpoints:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
