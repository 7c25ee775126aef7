"""The generic experiment loop every method shares.

``run(config, workdir)`` does, in this order:

1. :func:`ntk_fl.schema.validate_config` -- the config is checked once (the
   shared schema and the method's hyperparameters) and becomes frozen
   :class:`RunSettings`, which is all the rest reads; then the workdir
   (:func:`ntk_fl.rundir.check_start`: a fresh run needs an empty one, ``resume``
   needs a matching ``config.json`` and a checkpoint). Nothing is loaded before
   that, so a bad key or value fails in milliseconds with a message naming it.
   Everything below runs inside the run's device policy
   (:func:`ntk_fl.parallel.use_devices` with ``devices`` and ``chunk_size``).
2. :func:`build_experiment` -- dataset, partition, :class:`ntk_fl.data.Federation`, model and
   :class:`Algorithm` (also the entry point of the functional API: build once,
   then drive ``algorithm.init`` / ``algorithm.step`` yourself).
3. The round loop: ``algorithm.step`` (compiled once by its factory); after every round one
   JSON line in ``metrics.jsonl`` (aggregated-model and client accuracies,
   inter-client deviation, the algorithm's own metrics, timings), the same
   numbers as TensorBoard scalars in the workdir (:mod:`ntk_fl.summaries`), a
   tqdm progress bar, and an orbax checkpoint every ``checkpoint_every`` rounds
   and at the end.
4. Final client-selection curves, PNG plots, ``summary.json``.

The files of a workdir, resume and branching belong to :mod:`ntk_fl.rundir`.

The aggregated model is what ``algorithm.aggregate`` says: the uniform mean of
``client_params`` (default), or, for an ensemble method (Fed-ensemble), the
ensemble of those models with averaged probabilities/logits -- then the
per-client metrics are per-member metrics, the lines also carry the members'
and the ensemble's mean predictive entropy, and selection curves (which average
weights) are refused.

Determinism and resume: ``algorithm.init`` gets ``jax.random.key(seed)``,
``algorithm.round_inputs(r)`` depends on ``r`` only, and the state is the whole
carried pytree, so a run resumed from the checkpoint after round ``k`` repeats
rounds ``k+1..R`` bit for bit: its ``metrics.jsonl`` and ``summary.json`` equal
an uninterrupted run's except for wall-clock times. A branched run
(``run(..., branch_from=SOURCE)``, ``--branch_from``) starts from the checkpoint
of the run in ``SOURCE`` after ``k`` rounds and copies its metrics lines 1..k;
it equals the run started from scratch.

Seed-batched runs (``config.replicas = S > 1``, :func:`_run_replicas`): seeds
``seed .. seed+S-1`` are built as S experiments (each its own partition, topology
draws and initialisation), their states, round inputs and step data
(:class:`ntk_fl.algorithms.base.Replicable`) stacked on a leading replica axis,
and one compiled program steps them all (``lax.map`` over the replicas, or
``vmap`` of ``replica_chunk`` of them). ``WORKDIR/replicas.json`` names the
replicas' run directories ``WORKDIR/seed<k>/``; each is a normal run directory
(its own ``config.json`` with its own seed and ``replicas = 1``, metrics,
checkpoints, summary) equal to the single-seed run of that seed, and resumes
from its own checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ntk_fl import distributed, gossip, parallel, rundir
from ntk_fl import metrics as metrics_lib
from ntk_fl import plotting
from ntk_fl import summaries
from ntk_fl._src import cost
from ntk_fl.algorithms.base import Algorithm, get_method  # the registry, two levels deep
from ntk_fl.checkpoint import Checkpoints
from ntk_fl.rng import Stream, numpy_rng
from ntk_fl.schema import replica_settings, validate_config
from ntk_fl.settings import RunSettings

__all__ = [
  "Diverged",
  "Experiment",
  "ReplicatedStep",
  "make_finite_check",
  "make_replicated_step",
  "build_experiment",
  "cost_report",
  "make_algorithm",
  "run",
]

# Keys the runner writes into every metrics line; an algorithm metric may not reuse them.
_RESERVED = frozenset(
  {
    "round",
    "step_time",
    "eval_time",
    "test_acc",
    "test_loss",
    "deviation",
    "client_acc_mean",
    "client_acc_min",
    "client_acc_max",
    "client_loss_mean",
    "consensus_acc_mean",
    "consensus_acc_min",
    "consensus_acc_max",
    "consensus_loss_mean",
    "clients",
    *metrics_lib.ENSEMBLE_METRICS,
  }
)


# ----------------------------------------------------------------------------- building


class Experiment(NamedTuple):
  """Everything a run is made of, built from a config by :func:`build_experiment`.

  Attributes:
    settings: the checked :class:`ntk_fl.settings.RunSettings` it was built from.
    dataset: the (optionally subsampled) :class:`ntk_fl.data.Dataset`; in a run of
      several processes its ``x_train`` is ``None`` (each process keeps only its
      clients' samples, in ``federation``).
    client_indices: ``M`` index arrays into ``dataset.x_train``.
    federation: the stacked client data :class:`ntk_fl.data.Federation`.
    model: the :class:`ntk_fl.models.Model`.
    algorithm: the method's :class:`Algorithm`.
  """

  settings: RunSettings
  dataset: Any
  client_indices: list
  federation: Any
  model: Any
  algorithm: Algorithm

  def device_policy(self):
    """``with experiment.device_policy():`` -- the run's devices and chunk size (:func:`ntk_fl.parallel.use_devices`).

    The policy is read when a step is first traced: call ``algorithm.step`` (and
    the evaluators) inside it to get what the runner does.
    """
    return parallel.use_devices(
      self.settings.devices, chunk_size=self.settings.chunk_size, debug=self.settings.debug_clients
    )


def _keep(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
  """``size`` of ``range(n)`` drawn without replacement, in their original order."""
  return np.sort(rng.choice(n, size=size, replace=False))


def _subsample(dataset, max_train: int, max_test: int, seed: int):
  """Keeps ``max_train`` training and ``max_test`` test samples (``0`` = all), each drawn without replacement.

  The two draws come from their own streams (original order kept), so capping one
  split leaves the other's draw unchanged.
  """
  for split, size, n in (
    ("max_train", max_train, dataset.x_train.shape[0]),
    ("max_test", max_test, dataset.x_test.shape[0]),
  ):
    if size > n:
      raise ValueError(
        f"config.data.{split} = {size} exceeds the {n} {split[4:]} samples of "
        f"{dataset.name!r}; use 0 for all of them"
      )
  if max_train and max_train != dataset.x_train.shape[0]:
    keep = _keep(dataset.x_train.shape[0], max_train, numpy_rng(seed, Stream.SUBSAMPLE))
    writers = None if dataset.writers_train is None else dataset.writers_train[keep]
    from ntk_fl.data.sources import LazyFeatures  # pylint: disable=g-import-not-at-top

    x_train = dataset.x_train
    x_train = x_train.subset(keep) if isinstance(x_train, LazyFeatures) else x_train[keep]
    dataset = dataset._replace(
      x_train=x_train, y_train=dataset.y_train[keep], writers_train=writers
    )
  if max_test and max_test != dataset.x_test.shape[0]:
    keep = _keep(dataset.x_test.shape[0], max_test, numpy_rng(seed, Stream.TEST_SUBSAMPLE))
    dataset = dataset._replace(x_test=dataset.x_test[keep], y_test=dataset.y_test[keep])
  return dataset


def build_experiment(config) -> Experiment:
  """Checks ``config`` (once) and builds dataset, partition, federation, model and algorithm.

  Args:
    config: a run config (``ml_collections.ConfigDict``, or the plain dict of a
      run's ``config.json``) or :class:`RunSettings` already checked by
      :func:`ntk_fl.schema.validate_config`.

  The functional API: ``exp = build_experiment(config)``, then, inside
  ``exp.device_policy()``, ``state = exp.algorithm.init(jax.random.key(seed))``
  and ``state, metrics = exp.algorithm.step(state, exp.algorithm.round_inputs(r))``.
  """
  # The data modules themselves, not the ``ntk_fl.data`` face that re-exports them (one level less).
  from ntk_fl import models  # pylint: disable=g-import-not-at-top
  from ntk_fl.data.federation import make_federation  # pylint: disable=g-import-not-at-top
  from ntk_fl.data.partition import partition as partition_clients  # pylint: disable=g-import-not-at-top
  from ntk_fl.data.sources import load as load_dataset  # pylint: disable=g-import-not-at-top

  settings = validate_config(config)
  data_settings = settings.data
  mesh = parallel.current_mesh()
  # Several processes: each converts (and keeps) only its own clients' training samples. One process with
  # a training slice (data.max_train) converts only the slice's rows: the same float32 values (one table
  # lookup per pixel), without converting all 60,000 Fashion-MNIST images first (about a second of CPU).
  split = jax.process_count() > 1 and mesh is not None
  dataset = load_dataset(
    data_settings.name,
    data_settings.data_dir or None,
    flatten=models.flat_inputs(settings.model),
    seed=settings.seed,
    lazy_train=split or bool(data_settings.max_train),
  )
  dataset = _subsample(dataset, data_settings.max_train, data_settings.max_test, settings.seed)
  if not split and not isinstance(dataset.x_train, np.ndarray):  # a slice still unconverted
    dataset = dataset._replace(x_train=np.asarray(dataset.x_train))
  client_indices = partition_clients(
    dataset.y_train,
    data_settings.partition,
    data_settings.num_clients,
    seed=settings.seed,
    alpha=data_settings.alpha,
    samples_per_client=data_settings.samples_per_client or None,
    classes_per_client=data_settings.classes_per_client,
    keep_per_client=data_settings.keep_per_client or None,
    writers=dataset.writers_train,
    partition_file=data_settings.partition_file or None,
  )
  model = models.make_model(settings.model, dataset.x_train.shape[1:], dataset.num_classes)
  if split:
    # Several processes: each keeps only its own clients' samples (one block per local device) and drops
    # the rest of the training set; neighbours' samples are fetched inside the step (parallel.Shared).
    federation = distributed.place_federation(
      dataset.x_train, dataset.y_train, client_indices, mesh
    )
    held = sum(shard.data.shape[0] for shard in federation.samples_x.addressable_shards)
    held = distributed.process_allgather_ints(held)
    logging.info(
      "processes hold %s of the %d training samples' rows (one block of %d rows per device)",
      " / ".join(map(str, held)),
      dataset.x_train.shape[0],
      federation.samples_x.shape[0] // mesh.size,
    )
    dataset = dataset._replace(x_train=None)
  else:
    federation = make_federation(dataset.x_train, dataset.y_train, client_indices)
  return Experiment(
    settings,
    dataset,
    client_indices,
    federation,
    model,
    make_algorithm(settings, model, federation),
  )


def cost_report(config) -> str:
  """What ``ntk-fl --estimate`` prints: the cost of one round of ``config`` (a run config or checked
  settings) on this device, from one NTK step compiled and timed on a block of the run's size
  (:mod:`ntk_fl._src.cost`, as the run logs it before round 1), and the warning when a round exceeds 10
  minutes; for a method that takes no NTK step, a line saying so. Loads the data; runs no round and
  writes nothing.
  """
  exp = build_experiment(config)
  settings = exp.settings
  est = cost.estimate(settings, exp.model, exp.federation, ntk=get_method(settings.method).ntk)
  if est is None:
    return (
      f"no cost estimate: a {settings.method} round takes no NTK step (the estimate covers the NTK "
      "methods' client and server steps)"
    )
  text = cost.describe(est)
  if settings.replicas > 1:
    text += f" (one seed's; a round of the run computes its {settings.replicas} replicas)"
  warning = cost.over_budget(est, exp.model)
  return text + (f"\nwarning: {warning}" if warning else "")


def make_algorithm(config, model, federation) -> Algorithm:
  """The method of ``config`` on a given ``model`` and ``federation`` (your own data, a test's tiny one).

  What :func:`build_experiment` does after loading the data: the config is
  checked (once; :class:`RunSettings` pass as they are) and the method's factory
  gets the model, the federation, the run's topology (for a method that mixes
  over a graph), its typed hyperparameters and the run settings.
  """
  settings = validate_config(config)
  return get_method(settings.method).make(
    model, federation, settings.built_topology, settings.algorithm, settings
  )


# ----------------------------------------------------------------------------- the loop


def _strong(x):
  """A committed jax array without weak type, so restored and carried states compile alike."""
  x = jnp.asarray(x)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x
  return jnp.asarray(x, dtype=x.dtype)


def _canonical(state):
  return jax.tree.map(_strong, state)


class _NoEvents:
  """The TensorBoard writer of the processes other than 0 (they write no files)."""

  def write(self, line) -> None:
    del line

  def write_all(self, lines) -> None:
    del lines

  def write_config(self, config) -> None:
    del config

  def __enter__(self) -> _NoEvents:
    return self

  def __exit__(self, *exc) -> None:
    pass


def _initial_state(algorithm: Algorithm, config):
  """``algorithm.init`` from the config seed; across processes, each keeps only its clients' part.

  On several devices the state starts laid out as the sharded step returns it (clients split over the
  devices, the rest replicated), also in one process: a state on one device would make the second
  round's input layout differ from the first's, and the step compile a second time.
  """
  key = jax.random.key(config.seed)
  mesh = parallel.current_mesh()
  if jax.process_count() == 1 and mesh is None:
    return _canonical(algorithm.init(key))
  if jax.process_count() > 1 and mesh is not None and config.data.num_clients % mesh.size:
    logging.warning(
      "%d clients do not divide over %d devices: every process holds every client's model "
      "(choose a client count that is a multiple of the device count to split them)",
      config.data.num_clients,
      mesh.size,
    )
  shardings = distributed.client_shardings(
    jax.eval_shape(algorithm.init, key), config.data.num_clients, mesh
  )
  return _canonical(jax.jit(algorithm.init, out_shardings=shardings)(key))


def _due(round_: int, every: int, rounds: int) -> bool:
  """Whether a 1-based round gets an every-``every`` action (always the last round)."""
  return round_ == rounds or (every > 0 and round_ % every == 0)


class Diverged(ArithmeticError):
  """A round produced non-finite client models or losses (``config.on_divergence = 'stop'``).

  Raised by :func:`run` after ``summary.json`` (status ``diverged``) is written.
  Attributes: ``round`` (1-based), ``quantities`` (what was not finite), ``summary``.
  """

  def __init__(self, message: str, round_: int, quantities: list[str], summary: dict | None = None):
    super().__init__(message)
    self.round = round_
    self.quantities = quantities
    self.summary = summary


def _inexact(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def make_finite_check(client_params: Callable[[Any], Any]) -> Callable[[Any, dict], dict]:
  """A jitted ``check(state, step_metrics)`` -> a few booleans saying what is finite.

  One fused pass over the state on the device; only ``2 + M + #metrics`` booleans
  come back to the host (with the step metrics the loop fetches anyway):
  ``state`` (every float leaf finite), ``clients`` ``[M]`` (each client's model
  finite) and ``metrics`` (per float metric, e.g. the training ``loss``). A
  non-finite kernel shows up in the same round: the evolution and the weight
  update consume it, so the losses and the models it produces are not finite.
  """

  def check(state, step_metrics):
    floats = [x for x in jax.tree_util.tree_leaves(state) if _inexact(x)]
    state_ok = (
      jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats])) if floats else jnp.array(True)
    )
    params = [x for x in jax.tree_util.tree_leaves(client_params(state)) if _inexact(x)]
    num_clients = params[0].shape[0]
    clients_ok = jnp.all(
      jnp.stack([jnp.all(jnp.isfinite(x.reshape(num_clients, -1)), axis=1) for x in params]), axis=0
    )
    metrics_ok = {
      name: jnp.all(jnp.isfinite(jnp.asarray(value)))
      for name, value in step_metrics.items()
      if _inexact(value)
    }
    return {"state": state_ok, "clients": clients_ok, "metrics": metrics_ok}

  return jax.jit(check)


def _non_finite(flags: dict, line: dict) -> list[str]:
  """What this round left non-finite, in words (empty: the round is sound)."""
  found = []
  bad_clients = np.flatnonzero(~np.asarray(flags["clients"])).tolist()
  if bad_clients:
    shown = ", ".join(map(str, bad_clients[:10])) + (", ..." if len(bad_clients) > 10 else "")
    found.append(f"the models of {len(bad_clients)} of {len(flags['clients'])} clients ({shown})")
  elif not flags["state"]:
    found.append("the algorithm state (a non-parameter leaf, e.g. momentum or a server model)")
  found += [f"the algorithm metric {name!r}" for name, ok in flags["metrics"].items() if not ok]
  found += [
    f"the aggregated model's {key}"
    for key in ("test_loss",)
    if key in line and not math.isfinite(line[key])
  ]
  return found


def _divergence_message(
  config,
  round_: int,
  found: list[str],
  last_checkpoint: int | None,
  ckpt_dir: str | None,
  stop: bool,
) -> str:
  lr = getattr(config.algorithm, "lr", None)
  cause = (
    f"the learning rate is likely too large (config.algorithm.lr = {lr!r})"
    if lr is not None
    else "the learning rate (config.algorithm) is likely too large"
  )
  text = f"round {round_}: the run diverged: non-finite {'; '.join(found)}; {cause}"
  if not stop:
    return text + " (config.on_divergence = 'continue': the run goes on)"
  kept = (
    f"the last good checkpoint (after round {last_checkpoint}) is kept in {ckpt_dir}"
    if last_checkpoint is not None
    else "no checkpoint was written before it"
  )
  return (
    f"{text}. Stopped at round {round_}; {kept}; summary.json has status 'diverged'. Lower the learning "
    "rate, or set config.on_divergence='continue' to study the divergence"
  )


def _algorithm_metrics(step_metrics: dict, num_clients: int) -> tuple[dict, dict]:
  """Scalars -> floats; ``[M, ...]`` per-client arrays -> mean/min/max plus the full values under ``clients``."""
  line, clients = {}, {}
  for name, value in distributed.to_host(step_metrics).items():
    if name in _RESERVED:
      raise ValueError(
        f"algorithm metric {name!r} clashes with a runner metric; reserved: {sorted(_RESERVED)}"
      )
    value = np.asarray(value)
    if value.ndim == 0:
      line[name] = float(value)
    elif value.shape[0] == num_clients:
      line[f"{name}_mean"] = float(np.mean(value))
      line[f"{name}_min"] = float(np.min(value))
      line[f"{name}_max"] = float(np.max(value))
      clients[name] = value.tolist()
    else:
      line[name] = value.tolist()
  return line, clients


def _evaluate(
  evaluator: metrics_lib.Evaluator,
  stacked_params,
  round_: int,
  config,
  consensus_of: Callable[[Any], Any] | None = None,
) -> tuple[dict, dict]:
  """The round's evaluation line and per-client arrays; ``consensus_of(params)`` gives the consensus models."""
  line, clients = {}, {}
  if _due(round_, config.eval.every, config.rounds):
    acc, loss, deviation, *extra = distributed.to_host(evaluator.aggregate(stacked_params))
    line.update(test_acc=float(acc), test_loss=float(loss), deviation=float(deviation))
    line.update((name, float(value)) for name, value in zip(evaluator.extra_names, extra))
  if config.eval.clients_every and _due(round_, config.eval.clients_every, config.rounds):
    acc, loss = distributed.to_host(evaluator.clients(stacked_params))
    line.update(
      client_acc_mean=float(np.mean(acc)),
      client_acc_min=float(np.min(acc)),
      client_acc_max=float(np.max(acc)),
      client_loss_mean=float(np.mean(loss)),
    )
    clients["test_acc"] = acc.tolist()
    if consensus_of is not None:
      acc, loss = distributed.to_host(evaluator.clients(consensus_of(stacked_params)))
      line.update(
        consensus_acc_mean=float(np.mean(acc)),
        consensus_acc_min=float(np.min(acc)),
        consensus_acc_max=float(np.max(acc)),
        consensus_loss_mean=float(np.mean(loss)),
      )
      clients["consensus_acc"] = acc.tolist()
  return line, clients


def _reached_stop(line: dict, config) -> bool:
  """Early stop (``config.eval.stop_at > 0``): this round's aggregated accuracy reached it."""
  return (
    bool(config.eval.stop_at)
    and line.get("test_acc") is not None
    and line["test_acc"] >= config.eval.stop_at
  )


def _summarize(
  config,
  lines: list[dict],
  *,
  num_params: int,
  selection: dict | None,
  wall_time: float,
  resumed_from: int | None,
  branched_from: dict | None,
  diverged: dict | None = None,
) -> dict:
  acc = [line.get("test_acc") for line in lines]
  evaluated = [(a, line["round"]) for a, line in zip(acc, lines) if a is not None]
  best_acc, best_round = max(evaluated, key=lambda p: (p[0], -p[1])) if evaluated else (None, None)
  last_with = lambda key: next(
    (line[key] for line in reversed(lines) if line.get(key) is not None), None
  )
  step_times = [line["step_time"] for line in lines]
  round_times = [line["step_time"] + line["eval_time"] for line in lines]
  stopped = diverged is not None and config.on_divergence == "stop"
  if stopped:  # no "final" numbers: the run ended on a non-finite round, not after its last one
    last_with = lambda key: None
  return {
    "method": config.method,
    "seed": config.seed,
    "status": "diverged" if diverged is not None else "finished",
    # {"round", "quantities", "message"} of the first non-finite round, or None
    "diverged": diverged,
    "rounds": config.rounds,
    "rounds_run": len(lines),
    "stopped_early": bool(lines)
    and len(lines) < config.rounds
    and _reached_stop(lines[-1], config),
    "num_clients": config.data.num_clients,
    "num_params": num_params,
    "rounds_to_target": {
      str(float(t)): metrics_lib.rounds_to_target(acc, float(t)) for t in config.eval.targets
    },
    "final_test_acc": last_with("test_acc"),
    "final_test_loss": last_with("test_loss"),
    "final_client_acc_mean": last_with("client_acc_mean"),
    "final_consensus_acc_mean": last_with("consensus_acc_mean"),
    "final_deviation": last_with("deviation"),
    "best_test_acc": best_acc,
    "best_round": best_round,
    "wall_time": wall_time,
    "train_time": float(sum(step_times)),
    "time_per_round": float(np.mean(round_times)),
    # The first step includes jit compilation; later ones are the steady state.
    "step_time_per_round": float(np.mean(step_times[1:] if len(step_times) > 1 else step_times)),
    "resumed_from": resumed_from,
    "branched_from": branched_from,  # {"source": workdir, "round": rounds taken from it} or None
    "selection": selection,
    "config": config,
  }


def run(
  config,
  workdir: str,
  *,
  resume: bool = False,
  resume_from_step: int | None = None,
  branch_from: str | None = None,
  branch_round: int | None = None,
  on_round_end: Callable[[int, dict], None] | None = None,
) -> dict:
  """Runs the experiment described by ``config`` in ``workdir``; returns the summary.

  Args:
    config: a config built on :func:`ntk_fl.config.base_config`, or
      :class:`RunSettings` (:func:`ntk_fl.schema.validate_config`).
    workdir: output directory (created); see the module docstring for its layout.
    resume: continue from the newest good checkpoint in ``workdir`` (damaged or
      incomplete ones are set aside: renamed, never deleted).
    resume_from_step: continue from the checkpoint after this many rounds
      (implies ``resume``; later checkpoints are set aside).
    branch_from: start a new run in ``workdir`` from the checkpoint of the run in
      this directory after ``branch_round`` rounds, copying its metrics lines
      for those rounds (see :func:`ntk_fl.rundir.check_branch` for when that is allowed).
    branch_round: the source checkpoint (default: the latest one allowed).
    on_round_end: optional ``fn(round, line)`` called after each round's metrics
      line and checkpoint are written (1-based ``round``); for custom logging or
      early interruption (an exception it raises stops the run there).

  Returns:
    The summary dict written to ``summary.json``; for a seed-batched run (``config.replicas > 1``)
    ``{"method", "seed", "replicas", "runs": [each replica's summary], "wall_time", ...}``.

  Raises:
    ValueError: a bad config value (before any data is loaded), a workdir
      holding another run, resuming with a different config, or a branch the
      method does not certify.
    FileNotFoundError: resuming or branching without a run or checkpoint;
      missing data files.
  """
  started = time.perf_counter()
  settings = validate_config(config)
  # Every step/evaluation is traced inside the device policy, so for_each_client shards and chunks clients by it.
  with (
    parallel.use_devices(
      settings.devices, chunk_size=settings.chunk_size, debug=settings.debug_clients
    ),
    rundir.workdir_lock(workdir),
  ):  # one run per workdir (held by the caller already: kept)
    if settings.replicas > 1:
      if branch_from is not None or branch_round is not None:
        raise ValueError(
          f"config.replicas = {settings.replicas}: a seed-batched run cannot branch "
          "(branch_from); branch each seed's run on its own"
        )
      return _run_replicas(
        settings,
        workdir,
        resume=resume or resume_from_step is not None,
        resume_from_step=resume_from_step,
        on_round_end=on_round_end,
        started=started,
      )
    return _run(
      settings,
      workdir,
      resume=resume or resume_from_step is not None,
      resume_from_step=resume_from_step,
      branch_from=branch_from,
      branch_round=branch_round,
      on_round_end=on_round_end,
      started=started,
    )


def _run(
  config,
  workdir: str,
  *,
  resume: bool,
  resume_from_step: int | None,
  branch_from: str | None,
  branch_round: int | None,
  on_round_end,
  started: float,
) -> dict:
  """:func:`run` after validation, inside the device mesh: set up, start or restore, the rounds, the summary."""
  workdir = os.path.abspath(workdir)
  start = rundir.check_start(
    config,
    workdir,
    resume=resume,
    resume_from_step=resume_from_step,
    branch_from=branch_from,
    branch_round=branch_round,
  )
  resume = resume and start > 0  # nothing to resume: the old files were moved aside; a fresh start
  if branch_from is not None:
    branch_from = os.path.abspath(branch_from)

  exp = build_experiment(config)
  algorithm = exp.algorithm
  _check_selection(config, algorithm)
  os.makedirs(workdir, exist_ok=True)
  if (
    config.cost_estimate and start < config.rounds and jax.process_count() == 1
  ):  # NTK methods: FLOPs, memory, time of a round, logged
    cost.run_estimate(config, exp.model, exp.federation, ntk=get_method(config.method).ntk)
  state = _initial_state(algorithm, config)
  num_clients = jax.tree_util.tree_leaves(algorithm.client_params(state))[0].shape[0]
  num_params = sum(
    math.prod(w.shape[1:]) for w in jax.tree_util.tree_leaves(algorithm.client_params(state))
  )
  consensus = _consensus_scorer(algorithm, state, config)
  keep = tuple(int(r) for r in config.checkpoint_keep)
  ckpt = None
  if config.checkpoint_every or keep:
    ckpt = _run_checkpoints(config, workdir, keep, resume)
  # Every process has checked the workdir (and, resuming, will read its metrics) before process 0 writes to it.
  distributed.barrier("ntk_fl.runner: workdir checked")

  try:
    state, lines = _start(
      config, workdir, state, start, ckpt, resume=resume, branch_from=branch_from
    )
    state, diverged = _rounds(
      exp,
      config,
      workdir,
      state,
      lines,
      start,
      ckpt,
      consensus,
      num_clients,
      branch_from=branch_from,
      on_round_end=on_round_end,
    )
  finally:
    if ckpt is not None:
      ckpt.close()
  return _finish(
    exp,
    config,
    workdir,
    state,
    lines,
    num_params=num_params,
    started=started,
    resumed_from=start if resume else None,
    diverged=diverged,
  )


def _check_selection(config, algorithm: Algorithm) -> None:
  if config.eval.selection and algorithm.aggregate != "params":
    # Selection curves average client *weights*; for an ensemble of independent models that is meaningless.
    raise ValueError(
      f"method {config.method!r} evaluates an ensemble (aggregate = {algorithm.aggregate!r}); "
      "weight-averaging selection curves do not apply: set config.eval.selection = False"
    )


def _consensus_scorer(algorithm: Algorithm, state, config):
  """The jitted neighbourhood averaging ``config.eval.consensus`` scores, or ``None``."""
  if not config.eval.consensus:
    return None
  try:  # traces only: a method without a graph in its round inputs fails here, before any round
    jax.eval_shape(gossip.consensus, algorithm.client_params(state), algorithm.round_inputs(0))
  except ValueError as e:
    raise ValueError(
      f"config.eval.consensus=True scores neighbourhood averages, which method {config.method!r} "
      f"does not have: {e}"
    ) from None
  return jax.jit(gossip.consensus)


def _run_checkpoints(config, workdir: str, keep: tuple[int, ...], resume: bool) -> Checkpoints:
  """The run's checkpoints, tied to its config; a resume also reads those its ``config.json`` as written
  (by an older package version, before keys were added to the schema) tied them to."""
  accepted = rundir.written_identities(workdir) if resume else []
  return Checkpoints(
    rundir.checkpoint_dir(workdir),
    keep=keep,
    identity=rundir.run_identity(config),
    also_accept=accepted,
  )


def _start(config, workdir: str, state, start: int, ckpt, *, resume: bool, branch_from: str | None):
  """The state and metrics lines a run starts from: restored (resume, branch) or new; the config written."""
  if resume:
    state = _canonical(ckpt.restore(start, state))
    lines = rundir.metrics_up_to(workdir, start, "resume")
    logging.info("Resuming %s from the checkpoint after round %d", workdir, start)
  elif branch_from is not None:
    with Checkpoints(
      rundir.checkpoint_dir(branch_from),
      read_only=True,
      identity=rundir.stored_identity(branch_from),
      also_accept=rundir.written_identities(branch_from),
    ) as source:
      state = _canonical(source.restore(start, state))
    lines = rundir.metrics_up_to(branch_from, start, "branch")
    rundir.write_config(workdir, config)
    rundir.write_branch(workdir, branch_from, start)
    if ckpt is not None:
      ckpt.save(
        start, state
      )  # the branch resumes from its own workdir, whatever happens to the source
    logging.info("Branching %s from %s after round %d", workdir, branch_from, start)
  else:
    rundir.write_config(workdir, config)
    lines = []
  # Rewrite (atomically) to exactly the checkpointed rounds, then append.
  rundir.write_metrics(workdir, lines)
  return state, lines


def _stopped(diverged: dict | None, config) -> bool:
  return diverged is not None and config.on_divergence == "stop"


def _rounds(
  exp: Experiment,
  config,
  workdir: str,
  state,
  lines: list[dict],
  start: int,
  ckpt,
  consensus,
  num_clients: int,
  *,
  branch_from: str | None,
  on_round_end,
):
  """Rounds ``start + 1 ..`` until ``config.rounds``, the stop accuracy or a stopping divergence.

  Appends each round's metrics line to ``lines`` (and the files), checkpoints as configured.

  Returns:
    ``(state, diverged)``: the last state and ``{"round", "quantities", "message"}`` of the first
    non-finite round (``None`` if every round was finite).
  """
  algorithm, rounds = exp.algorithm, config.rounds
  keep = tuple(int(r) for r in config.checkpoint_keep)
  finite_check = make_finite_check(algorithm.client_params)
  diverged = None  # {"round", "quantities", "message"} of the first non-finite round
  step = algorithm.step  # compiled by the method's factory (see Algorithm); re-jitting would bake
  # the federation arrays it passes as arguments into the program as constants
  evaluator = metrics_lib.make_evaluator(
    exp.model.apply,
    exp.dataset.x_test,
    exp.dataset.y_test,
    batch_size=config.eval.batch_size,
    aggregate=algorithm.aggregate,
  )
  primary = distributed.is_primary()  # only process 0 writes files, logs and the progress bar
  if primary and start:
    rundir.drop_event_files(workdir)  # metrics.jsonl is the record; a killed writer lost rounds
  events = summaries.EventWriter(workdir, first_round=start + 1) if primary else _NoEvents()
  events.write_config(rundir.jsonable(config))  # TensorBoard's HParams tab compares runs by it
  events.write_all(lines)  # rounds 1..start: the source's (branch) or this run's own (resume)
  # The first round's step and evaluation compile first: the bar says so until that round is done.
  bar = tqdm(
    total=rounds,
    initial=start,
    desc=f"{config.method}: compiling round {start + 1}",
    unit="round",
    dynamic_ncols=True,
    disable=not primary,
  )
  last_round = start
  metrics_path = os.path.join(workdir, rundir.METRICS_FILE)
  with (
    events,
    bar,
    open(metrics_path, "a") if primary else contextlib.nullcontext() as metrics_file,
  ):
    for r in range(start, rounds):
      if lines and _reached_stop(lines[-1], config):
        break
      round_ = r + 1
      inputs = algorithm.round_inputs(r)
      t0 = time.perf_counter()
      state, step_metrics = step(state, inputs)
      state = _canonical(jax.block_until_ready(state))
      # One transfer: the step metrics and the few finiteness flags of the state.
      step_metrics, flags = distributed.to_host((step_metrics, finite_check(state, step_metrics)))
      algo_line, algo_clients = _algorithm_metrics(step_metrics, num_clients)
      t1 = time.perf_counter()
      consensus_of = None
      if (
        consensus is not None
      ):  # the models the next round (0-based index r + 1) starts from; its graph
        # is drawn only when _evaluate scores the clients this round (called within this iteration)
        consensus_of = lambda params: consensus(params, algorithm.round_inputs(r + 1))  # pylint: disable=cell-var-from-loop
      eval_line, eval_clients = _evaluate(
        evaluator, algorithm.client_params(state), round_, config, consensus_of
      )
      t2 = time.perf_counter()
      line = {
        "round": round_,
        "step_time": t1 - t0,
        "eval_time": t2 - t1,
        **eval_line,
        **algo_line,
        "clients": {**eval_clients, **algo_clients},
      }
      if primary:
        metrics_file.write(rundir.metrics_line(line))
        metrics_file.flush()
      lines.append(
        rundir.jsonable(line)
      )  # exactly what was logged (NaN -> None), as a resumed run reads it
      events.write(lines[-1])
      found = _non_finite(flags, line)
      if found and diverged is None:
        diverged = _divergence(config, round_, found, ckpt)
        if _stopped(
          diverged, config
        ):  # the non-finite state is not checkpointed: the last good one stays
          logging.info(
            "%s", diverged["message"]
          )  # to the log; the caller reports the Diverged run raises
          break
        logging.warning("%s", diverged["message"])
      if ckpt is not None and (
        (config.checkpoint_every and _due(round_, config.checkpoint_every, rounds))
        or round_ in keep
      ):
        ckpt.save(round_, state)
      _show_progress(
        bar, line, first=r == start, method=config.method, primary=primary, t0=t0, t1=t1, t2=t2
      )
      last_round = round_
      if on_round_end is not None:
        on_round_end(round_, line)
  if (
    ckpt is not None
    and config.checkpoint_every
    and last_round not in ckpt.steps()
    and not _stopped(diverged, config)
  ):
    ckpt.save(last_round, state)  # e.g. a resumed run whose last checkpoint was deleted
  return state, diverged


def _divergence(config, round_: int, found, ckpt) -> dict:
  """``{"round", "quantities", "message"}`` of the first non-finite round."""
  last_good = (
    max((s for s in ckpt.steps() if s < round_), default=None) if ckpt is not None else None
  )
  message = _divergence_message(
    config,
    round_,
    found,
    last_good,
    ckpt.directory if ckpt is not None else None,
    config.on_divergence == "stop",
  )
  return {"round": round_, "quantities": found, "message": message}


def _show_progress(
  bar, line: dict, *, first: bool, method: str, primary: bool, t0: float, t1: float, t2: float
) -> None:
  """The progress bar (and the log line) after a round."""
  postfix = {}
  if "test_acc" in line and primary:
    postfix["acc"] = f"{line['test_acc']:.4f}"
    logging.info(
      "round %d: aggregated acc %.4f, step %.2fs, eval %.2fs",
      line["round"],
      line["test_acc"],
      t1 - t0,
      t2 - t1,
    )
  postfix["last round"] = f"{t2 - t0:.2f}s"
  if first:
    bar.set_description_str(method, refresh=False)
  bar.set_postfix(postfix)
  bar.update(1)


def _finish(
  exp: Experiment,
  config,
  workdir: str,
  state,
  lines: list[dict],
  *,
  num_params: int,
  started: float,
  resumed_from: int | None,
  diverged: dict | None,
) -> dict:
  """Selection curves, plots and ``summary.json`` of a run whose rounds are done; raises :class:`Diverged`."""
  algorithm = exp.algorithm
  selection = None
  title = f"{config.method} ({config.data.name}, seed {config.seed})"
  if config.eval.selection and diverged is None:  # curves of non-finite models would say nothing
    curves = metrics_lib.selection_curves(
      exp.model.apply,
      algorithm.client_params(state),
      exp.dataset.x_test,
      exp.dataset.y_test,
      seed=config.seed,
      batch_size=config.eval.batch_size,
    )
    selection = {k: v.tolist() for k, v in curves.items()}
    if distributed.is_primary():
      plotting.plot_selection_curves(
        curves, os.path.join(workdir, rundir.SELECTION_PLOT), title=title
      )
  if distributed.is_primary():
    plotting.plot_run(lines, workdir, title=title)  # accuracy, losses, bits vs accuracy; PNG, PDF

  summary = rundir.jsonable(
    _summarize(
      config,
      lines,
      num_params=num_params,
      selection=selection,
      wall_time=time.perf_counter() - started,
      resumed_from=resumed_from,
      branched_from=rundir.read_branch(workdir),
      diverged=diverged,
    )
  )
  rundir.write_summary(workdir, summary)
  distributed.barrier(
    "ntk_fl.runner: run written"
  )  # no process leaves before the run's files are written
  if _stopped(diverged, config):
    raise Diverged(diverged["message"], diverged["round"], diverged["quantities"], summary)
  if distributed.is_primary():
    logging.info(
      "Finished %s: %s", workdir, {k: summary[k] for k in ("rounds_to_target", "final_test_acc")}
    )
  return summary


# ----------------------------------------------------------------------------- seed-batched runs


def _stack(trees: list):
  """``S`` pytrees of equal structure -> one whose leaves carry a leading replica axis ``S``."""
  return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *trees)


def _replica(tree, k: int):
  """Replica ``k`` of a stacked pytree (the leading axis taken away)."""
  return jax.tree.map(lambda x: x[k], tree)


def _stack_inputs(inputs: list, seeds: Sequence[int]) -> Any:
  """The replicas' round inputs stacked; inputs of different shapes are a ``ValueError`` naming the seeds."""
  for seed, tree in zip(seeds[1:], inputs[1:]):
    if _shapes(tree) != _shapes(inputs[0]):
      raise ValueError(
        f"config.replicas: seeds {seeds[0]} and {seed} draw round inputs of "
        f"different shapes ({[s for s, _ in _shapes(inputs[0])]} vs {[s for s, _ in _shapes(tree)]}), "
        "e.g. graphs of different maximum degree: fix config.topology.k_max, or run the seeds separately"
      )
  return _stack(inputs)


def _shapes(tree) -> list:
  return [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree)]


def _replicable(exps: list[Experiment]):
  """The replicas' common step and their data split into stacked (per seed) and shared leaves.

  Raises ``ValueError`` for a method without a :class:`~ntk_fl.algorithms.base.Replicable` step or seeds
  whose arrays differ in shape (the replica axis needs one shape).
  """
  method = exps[0].settings.method
  if any(e.algorithm.replicable is None for e in exps):
    raise ValueError(
      f"config.replicas = {len(exps)}: method {method!r} does not support seed-batched runs "
      "(its Algorithm has no replicable step); set config.replicas = 1 and run the seeds separately"
    )
  datas = [e.algorithm.replicable.data for e in exps]
  for name, trees in (("step data (the federation)", datas),):
    first = jax.tree.structure(trees[0]), _shapes(trees[0])
    for e, tree in zip(exps[1:], trees[1:]):
      if (jax.tree.structure(tree), _shapes(tree)) != first:
        raise ValueError(
          f"config.replicas: seeds {exps[0].settings.seed} and {e.settings.seed} give {name} of "
          f"different shapes ({[s for s, _ in first[1]]} vs {[s for s, _ in _shapes(tree)]}): "
          "seed-batched runs need one shape, e.g. a partition with equal client sizes "
          "(config.data.samples_per_client); run the seeds separately otherwise"
        )
  leaves = [jax.tree.leaves(d) for d in datas]
  treedef = jax.tree.structure(datas[0])
  stacked, shared = [], []
  for column in zip(*leaves):
    same = all(
      x is column[0] or np.array_equal(np.asarray(x), np.asarray(column[0])) for x in column
    )
    # A leaf every seed shares (e.g. the training set when no seed subsamples it) is passed once.
    stacked.append(None if same else jnp.stack(column))
    shared.append(column[0] if same else None)
  return exps[0].algorithm.replicable.step, treedef, stacked, shared


def _make_replicated_step(step, treedef, num_replicas: int, replica_chunk: int):
  """One jitted ``(states, inputs, stacked, shared) -> (states, metrics)`` over the replica axis.

  ``replica_chunk = 1``: ``lax.map``, each replica's round is the single-seed program's (bit-identical on the
  CPU); ``0`` or ``>= S``: one ``vmap`` of all; otherwise ``lax.map`` of ``vmap`` chunks of that size.
  ``stacked`` / ``shared``: the step data's leaves, ``[S, ...]`` or ``None`` / one copy or ``None``.
  """

  def one(args, shared):
    state, inputs, leaves = args
    data = jax.tree.unflatten(treedef, [s if x is None else x for x, s in zip(leaves, shared)])
    return step(state, inputs, data)

  @jax.jit
  def replicated(states, inputs, stacked, shared):
    xs = (states, inputs, stacked)
    fn = functools.partial(one, shared=shared)
    if replica_chunk == 1:
      return jax.lax.map(fn, xs)
    if replica_chunk == 0 or replica_chunk >= num_replicas:
      return jax.vmap(fn)(xs)
    return jax.lax.map(fn, xs, batch_size=replica_chunk)

  return replicated


class ReplicatedStep(NamedTuple):
  """``S`` seeds' runs of one method as one step over a leading replica axis ``S`` (a seed-batched run).

  Built by :func:`make_replicated_step`; :func:`run` drives a run of ``config.replicas > 1`` with it, and a
  benchmark can time it alone. ``stacked`` / ``shared``: the step data's leaves, ``[S, ...]`` where the
  seeds differ, one copy where they agree.
  """

  step: Callable  # jitted (states, inputs, stacked, shared) -> (states, metrics); leaves [S, ...]
  stacked: list
  shared: list
  seeds: tuple[int, ...]

  def __call__(self, states, inputs):
    """``(states [S, ...], inputs [S, ...]) -> (states, metrics)``: one round of every replica."""
    return self.step(states, inputs, self.stacked, self.shared)

  def stack_states(self, states: list):
    """``S`` replicas' states (one per seed, in order) -> one state with a leading replica axis."""
    return _stack(states)

  def stack_inputs(self, inputs: list):
    """``S`` replicas' round inputs -> one pytree ``[S, ...]``; a ``ValueError`` naming two seeds whose
    inputs differ in shape (the replica axis needs one shape)."""
    return _stack_inputs(inputs, self.seeds)

  def replica(self, tree, k: int):
    """Replica ``k`` of a stacked pytree (states or metrics), the replica axis taken away."""
    return _replica(tree, k)


def make_replicated_step(exps: Sequence[Experiment], replica_chunk: int = 0) -> ReplicatedStep:
  """The seed-batched step of ``S = len(exps)`` experiments of one method (one per seed).

  ``replica_chunk``: ``1`` maps the replicas one after another (each replica's round is the single-seed
  program's, bit-identical on the CPU); ``0`` (or ``>= S``) one ``vmap`` of all; otherwise ``vmap`` chunks of
  that size. Raises ``ValueError`` for a method without a replicable step or seeds whose step data differ
  in shape. Call it, and the step, inside ``exps[0].device_policy()``.
  """
  step, treedef, stacked, shared = _replicable(list(exps))
  replicated = _make_replicated_step(step, treedef, len(exps), replica_chunk)
  return ReplicatedStep(replicated, stacked, shared, tuple(e.settings.seed for e in exps))


class _ReplicaRun:
  """One replica's records: its workdir, metrics lines, checkpoints, evaluator and progress."""

  def __init__(self, exp: Experiment, workdir: str, start: int, resume: bool):
    self.exp, self.config, self.workdir = exp, exp.settings, workdir
    self.start, self.resume = start, resume
    self.algorithm = exp.algorithm
    keep = tuple(int(r) for r in self.config.checkpoint_keep)
    self.keep = keep
    self.ckpt = None
    if self.config.checkpoint_every or keep:
      self.ckpt = _run_checkpoints(self.config, workdir, keep, resume)
    self.diverged = None
    self.done = False
    self.last_round = start
    self.final_state = None

  def open(self, state):
    """Restores or writes the start; returns the state this replica starts from."""
    os.makedirs(self.workdir, exist_ok=True)
    state, self.lines = _start(
      self.config, self.workdir, state, self.start, self.ckpt, resume=self.resume, branch_from=None
    )
    params = jax.tree_util.tree_leaves(self.algorithm.client_params(state))
    self.num_clients = params[0].shape[0]
    self.num_params = sum(math.prod(w.shape[1:]) for w in params)
    self.consensus = _consensus_scorer(self.algorithm, state, self.config)
    self.finite_check = make_finite_check(self.algorithm.client_params)
    self.evaluator = metrics_lib.make_evaluator(
      self.exp.model.apply,
      self.exp.dataset.x_test,
      self.exp.dataset.y_test,
      batch_size=self.config.eval.batch_size,
      aggregate=self.algorithm.aggregate,
    )
    if self.start:
      rundir.drop_event_files(self.workdir)
    self.events = summaries.EventWriter(self.workdir, first_round=self.start + 1)
    self.events.__enter__()
    self.events.write_config(rundir.jsonable(self.config))
    self.events.write_all(self.lines)
    self.metrics_file = open(os.path.join(self.workdir, rundir.METRICS_FILE), "a")
    self.done = self.start >= self.config.rounds or bool(
      self.lines and _reached_stop(self.lines[-1], self.config)
    )
    return state

  def record(self, r: int, state, step_metrics, t0: float, t1: float, on_round_end) -> None:
    """Round ``r + 1``'s metrics line, checkpoint and stop rules (the loop body of :func:`_rounds`)."""
    config, algorithm = self.config, self.algorithm
    round_ = r + 1
    step_metrics, flags = distributed.to_host(
      (step_metrics, self.finite_check(state, step_metrics))
    )
    algo_line, algo_clients = _algorithm_metrics(step_metrics, self.num_clients)
    t1e = time.perf_counter()
    consensus_of = None
    if self.consensus is not None:
      consensus_of = lambda params: self.consensus(params, algorithm.round_inputs(r + 1))
    eval_line, eval_clients = _evaluate(
      self.evaluator, algorithm.client_params(state), round_, config, consensus_of
    )
    t2 = time.perf_counter()
    line = {
      "round": round_,
      "step_time": t1 - t0,  # the replicated step: every replica's round together
      "eval_time": t2 - t1e,
      **eval_line,
      **algo_line,
      "clients": {**eval_clients, **algo_clients},
    }
    self.metrics_file.write(rundir.metrics_line(line))
    self.metrics_file.flush()
    self.lines.append(rundir.jsonable(line))
    self.events.write(self.lines[-1])
    self.last_round = round_
    found = _non_finite(flags, line)
    if found and self.diverged is None:
      self.diverged = _divergence(config, round_, found, self.ckpt)
      if _stopped(self.diverged, config):
        logging.info("%s: %s", self.workdir, self.diverged["message"])
        self.done = True
        return
      logging.warning("%s: %s", self.workdir, self.diverged["message"])
    if self.ckpt is not None and (
      (config.checkpoint_every and _due(round_, config.checkpoint_every, config.rounds))
      or round_ in self.keep
    ):
      self.ckpt.save(round_, state)
    self.final_state = state
    if round_ >= config.rounds or _reached_stop(self.lines[-1], config):
      self.done = True
    if on_round_end is not None:
      on_round_end(round_, line)

  def close(self, state) -> None:
    """The final checkpoint, as :func:`_rounds` writes it."""
    if (
      self.ckpt is not None
      and self.config.checkpoint_every
      and self.last_round not in self.ckpt.steps()
      and not _stopped(self.diverged, self.config)
    ):
      self.ckpt.save(self.last_round, state)

  def shutdown(self) -> None:
    """Closes the files, the event writer and the checkpoints (also after an error or Ctrl-C)."""
    metrics_file, events = (
      self.__dict__.pop("metrics_file", None),
      self.__dict__.pop("events", None),
    )
    if metrics_file is not None:
      metrics_file.close()
    if events is not None:
      events.__exit__(None, None, None)
    if self.ckpt is not None:
      self.ckpt.close()


def _run_replicas(
  config,
  workdir: str,
  *,
  resume: bool,
  resume_from_step: int | None,
  on_round_end,
  started: float,
) -> dict:
  """A seed-batched run (``config.replicas > 1``): S single-seed runs stepped by one compiled program.

  Each replica ``k`` (seed ``seed + k``) writes ``WORKDIR/seed<seed+k>/`` as its single-seed run would,
  resumes from its own checkpoint (replicas may start from different rounds: each gets its own round's
  inputs) and stops on its own (``eval.stop_at``, divergence); a replica that is done is still stepped
  (the replica axis keeps its shape) but nothing of it is recorded. ``on_round_end(round, line)`` is
  called for every replica's line. Returns ``{"method", "seed", "replicas", "runs": [summaries]}`` plus
  the closing line's fields of the first replica; raises the first replica's :class:`Diverged` after
  every replica is written.
  """
  if jax.process_count() > 1:
    raise ValueError(
      f"config.replicas = {config.replicas} runs in one process; a run of "
      f"{jax.process_count()} processes takes config.replicas = 1"
    )
  if parallel.num_client_shards() > 1:
    raise ValueError(
      f"config.replicas = {config.replicas} runs on one device; set config.devices = 1 "
      f"(the clients are sharded over {parallel.num_client_shards()} devices)"
    )
  workdir = os.path.abspath(workdir)
  rundir.check_replicas_workdir(config, workdir, resume=resume)
  runs = replica_settings(config)
  dirs = [rundir.replica_dir(workdir, run.seed) for run in runs]
  with contextlib.ExitStack() as stack:
    for d in dirs:  # a single-seed run of one replica's folder would refuse while this run holds it
      stack.enter_context(rundir.workdir_lock(d))
    starts = [
      rundir.check_start(run, d, resume=resume, resume_from_step=resume_from_step)
      for run, d in zip(runs, dirs)
    ]
    exps = [build_experiment(run) for run in runs]
    replicated = make_replicated_step(exps, config.replica_chunk)
    for exp in exps:
      _check_selection(exp.settings, exp.algorithm)
    os.makedirs(workdir, exist_ok=True)
    rundir.write_replicas(workdir, config)
    if config.cost_estimate and min(starts) < config.rounds:
      ntk = get_method(runs[0].method).ntk
      cost.run_estimate(runs[0], exps[0].model, exps[0].federation, ntk=ntk)
    replicas = [
      _ReplicaRun(exp, d, start, resume and start > 0) for exp, d, start in zip(exps, dirs, starts)
    ]
    try:
      states = [r.open(_initial_state(e.algorithm, e.settings)) for r, e in zip(replicas, exps)]
      states = _rounds_replicated(replicas, states, replicated, config, on_round_end)
      for rep, state in zip(replicas, states):
        rep.close(state)
    finally:
      for rep in replicas:
        rep.shutdown()
    summaries_, failure = [], None
    for rep, state in zip(replicas, states):
      try:
        summaries_.append(
          _finish(
            rep.exp,
            rep.config,
            rep.workdir,
            state,
            rep.lines,
            num_params=rep.num_params,
            started=started,
            resumed_from=rep.start if rep.resume else None,
            diverged=rep.diverged,
          )
        )
      except Diverged as e:
        summaries_.append(e.summary)
        failure = failure or e
  if failure is not None:
    raise failure
  first = summaries_[0]
  return {
    **{k: first[k] for k in ("method", "rounds_run", "rounds_to_target", "final_test_acc")},
    "seed": config.seed,
    "replicas": config.replicas,
    "runs": summaries_,
    "wall_time": time.perf_counter() - started,
  }


def _rounds_replicated(
  replicas: list[_ReplicaRun], states: list, replicated: ReplicatedStep, config, on_round_end
) -> list:
  """The rounds of every replica, one replicated step at a time; returns each replica's final state."""
  num = len(replicas)
  carried = _canonical(replicated.stack_states(states))
  finals = list(states)
  rounds = config.rounds
  t = 0
  bar = tqdm(
    total=rounds,
    initial=min(r.start for r in replicas),
    desc=f"{config.method} x{num}: compiling",
    unit="round",
    dynamic_ncols=True,
  )
  with bar:
    while not all(r.done for r in replicas):
      # Replica k is at round start_k + t; a replica that is done gets its last round's inputs (unused).
      index = [min(r.start + t, rounds - 1) for r in replicas]
      inputs = replicated.stack_inputs(
        [r.algorithm.round_inputs(i) for r, i in zip(replicas, index)]
      )
      t0 = time.perf_counter()
      carried, metrics = replicated(carried, inputs)
      carried = _canonical(jax.block_until_ready(carried))
      t1 = time.perf_counter()
      for k, rep in enumerate(replicas):
        if rep.done:
          continue
        state = _replica(carried, k)
        rep.record(index[k], state, _replica(metrics, k), t0, t1, on_round_end)
        if rep.final_state is state:
          finals[k] = state
      t += 1
      if t == 1:
        bar.set_description_str(f"{config.method} x{num}", refresh=False)
      bar.set_postfix({"last round": f"{time.perf_counter() - t0:.2f}s"})
      bar.update(1)
  return finals
