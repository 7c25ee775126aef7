"""The interface every federated method implements.

An :class:`Algorithm` is a bundle of pure functions, in the spirit of
``optax.GradientTransformation`` and FedJAX's ``FederatedAlgorithm``:

* ``init(key) -> state``: the initial state, a pytree whose per-client leaves
  have a leading client axis ``M`` (parameters, optimiser states, velocities).
* ``round_inputs(round) -> inputs``: host-side, deterministic in the config seed
  and the round index (graph draw, client sampling, PRNG key of the round). It
  is a function of ``round`` only, so a resumed run sees exactly the inputs of
  the uninterrupted one.
* ``step(state, inputs) -> (state, metrics)``: one synchronous round; pure and
  already ``jit``-compiled by the factory, which passes large arrays (the
  federation) to the compiled function as arguments -- callers use ``step`` as
  is, since wrapping it in another ``jax.jit`` would bake those arrays into the
  program as constants. Inputs have fixed shapes every round, so it compiles
  once. ``metrics`` is a flat dict of arrays (scalars or ``[M]`` per-client
  values).
* ``client_params(state) -> params``: the stacked ``[M, ...]`` model
  parameters that evaluation scores (aggregated model = their uniform mean).
* ``aggregate`` (optional, default ``'params'``): what "the aggregated model"
  means for evaluation (:data:`AGGREGATES`). ``'params'``: the uniform mean of
  ``client_params`` (one model). ``'ensemble_probs'`` / ``'ensemble_logits'``:
  the rows of ``client_params`` are independent ensemble members (Fed-ensemble's
  modes), whose softmax probabilities / logits are averaged per test sample --
  averaging their weights would be meaningless.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from ntk_fl.metrics import AGGREGATES  # the evaluator owns the choices; re-exported for methods

__all__ = ["AGGREGATES", "Algorithm", "ParamsState", "GraphRound", "check_evolution", "config_without",
           "graph_round_inputs"]


class Algorithm(NamedTuple):
  init: Callable[[Any], Any]
  round_inputs: Callable[[int], Any]
  step: Callable[[Any, Any], tuple[Any, dict]]
  client_params: Callable[[Any], Any]
  aggregate: str = "params"


class ParamsState(NamedTuple):
  """The state of a method that carries only its models and the bits it has sent.

  Attributes:
    params: the models: leaves ``[M, ...]`` with a client axis (decentralised methods), or one global
      model without it (server methods).
    bits_cumulative: float32 scalar, bits sent by all clients so far.
  """
  params: Any
  bits_cumulative: Any


class GraphRound(NamedTuple):
  """Inputs of one decentralized round: the round's graph, mixing weights and key.

  Host-side draw with fixed shapes, so a step compiles once.

  Attributes:
    round: int32 scalar, 0-based round index (learning-rate schedules, annealing).
    neighbors: int32 ``[M, k_max]`` neighbour indices (padded slots = own index).
    neighbor_mask: bool ``[M, k_max]``.
    self_weight: float32 ``[M]`` weight of a client's own model when mixing.
    neighbor_weights: float32 ``[M, k_max]`` weights of the neighbours (0 in padding).
    key: PRNG key of the round.
  """
  round: Any
  neighbors: Any
  neighbor_mask: Any
  self_weight: Any
  neighbor_weights: Any
  key: Any


def graph_round_inputs(graph_source, mixing: str, sizes, seed: int) -> Callable[[int], GraphRound]:
  """``round_inputs`` of a decentralized method: a function of the round index only.

  Args:
    graph_source: a :class:`ntk_fl.topology.Topology` (``sample(round) -> Graph``).
    mixing: mixing scheme for :func:`ntk_fl.topology.mixing_weights`.
    sizes: ``[M]`` client data sizes (data-size weights).
    seed: the config seed; round ``r``'s key is ``rng.jax_key(seed, Stream.ROUND_KEYS, r)``.
  """
  from ntk_fl import rng, topology  # pylint: disable=import-outside-toplevel -- base stays light to import

  def round_inputs(round_index: int) -> GraphRound:
    graph = graph_source.sample(round_index)
    self_w, nbr_w = topology.mixing_weights(graph, mixing, sizes)
    return GraphRound(round=np.int32(round_index), neighbors=graph.neighbors, neighbor_mask=graph.mask,
                      self_weight=self_w, neighbor_weights=nbr_w, key=rng.jax_key(seed, rng.Stream.ROUND_KEYS, round_index))

  return round_inputs


def config_without(config: dict, *paths: str) -> dict:
  """A JSON config dict (as in a run's ``config.json``) without the dotted ``paths``.

  For ``Method.shared_rounds``: two configs equal after dropping the keys a
  method knows its rounds do not read (e.g. ``'rounds'``, ``'eval.stop_at'``).
  """
  heads = {}
  for path in paths:
    head, _, rest = path.partition(".")
    heads.setdefault(head, []).append(rest)
  out = {}
  for key, value in config.items():
    rests = heads.get(key)
    if rests is None:
      out[key] = value
    elif "" not in rests:             # drop below this key, keep the key
      out[key] = config_without(value, *rests)
  return out


def check_evolution(hparams: Any, path: str = "config.algorithm") -> None:
  """Checks the NTK-evolution fields every NTK method's hyperparameters share (once, on construction).

  ``lr`` (> 0), ``lr_decay`` (>= 0, ``η_r = η·exp(−decay·r)``), ``taus`` (see
  :func:`ntk_fl.evolve.check_taus`), ``solver``, ``select``, ``kernel`` and, where
  the dataclass has it, ``loss`` (the ODE solver is for cross-entropy only).
  """
  from ntk_fl import evolve, validation  # pylint: disable=import-outside-toplevel -- base stays light to import

  validation.check_real(f"{path}.lr", hparams.lr, low=0, low_open=True)
  validation.check_real(f"{path}.lr_decay (η_r = η·exp(−decay·r))", hparams.lr_decay, low=0)
  try:
    evolve.check_taus(tuple(hparams.taus))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}.taus: {e}") from e
  choices = (("solver", evolve.SOLVERS), ("select", evolve.SELECTS), ("kernel", evolve.KERNELS))
  has_loss = hasattr(hparams, "loss")
  if has_loss:
    choices = (("loss", evolve.LOSSES),) + choices
  for name, allowed in choices:
    validation.check_choice(f"{path}.{name}", getattr(hparams, name), allowed)
  if has_loss:
    try:
      evolve.check_loss_solver(evolve.Loss(hparams.loss), evolve.Solver(hparams.solver))
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None
