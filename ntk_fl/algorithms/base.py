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
* ``replicable`` (optional, default ``None``): the step as a pure function of its
  data (:class:`Replicable`), for seed-batched runs (``config.replicas``): the
  runner stacks several seeds' data on a leading replica axis and maps the step
  over it in one compiled program. A method without it runs one seed at a time.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, NamedTuple, Protocol
from collections.abc import Callable

import jax

from ntk_fl._src.options import (
  AGGREGATES,
)  # evaluation's choices (ntk_fl.metrics), re-exported for methods

__all__ = [
  "AGGREGATES",
  "Algorithm",
  "ClientFn",
  "ClientParamsFn",
  "InitFn",
  "MakeFn",
  "Method",
  "ParamsState",
  "GraphRound",
  "Replicable",
  "RoundInputsFn",
  "RunOptions",
  "ScoreFn",
  "StepFn",
  "TargetsFn",
  "check_evolution",
  "available",
  "config_without",
  "get_method",
  "parse_enums",
  "register",
  "run_options",
]


class InitFn(Protocol):
  """``init(key) -> state``: a method's initial state."""

  def __call__(self, key: jax.Array) -> Any:
    """Args: key: the run's initialisation PRNG key. Returns: the state, a pytree whose per-client leaves
    carry a leading client axis ``M`` (parameters, optimiser states, velocities)."""


class RoundInputsFn(Protocol):
  """``round_inputs(round) -> inputs``: host-side inputs of a round, a function of its index only."""

  def __call__(self, round_index: int) -> Any:
    """Args: round_index: the 0-based round. Returns: a pytree of fixed-shape arrays (e.g.
    :class:`GraphRound`), deterministic in the config seed and ``round_index`` (so a resumed run sees the
    inputs of the uninterrupted one)."""


class StepFn(Protocol):
  """``step(state, inputs) -> (state, metrics)``: one synchronous round, pure and already jit-compiled."""

  def __call__(self, state: Any, inputs: Any) -> tuple[Any, dict]:
    """Args: state: the round-start state; inputs: ``round_inputs(r)``. Returns: the round-end state and a
    flat dict of metric arrays (scalars or ``[M]`` per-client values)."""


class ClientParamsFn(Protocol):
  """``client_params(state) -> params``: the stacked ``[M, ...]`` models evaluation scores."""

  def __call__(self, state: Any) -> Any:
    """Args: state: a state of the method. Returns: the model parameters, leaves ``[M, ...]``."""


class ClientFn(Protocol):
  """A neighbourhood client function, mapped over the clients by ``NeighbourhoodRound.run``.

  The neighbourhood's data come in ``m1`` blocks (``config.algorithm.jacobian_batches``, App. E.1 of
  NTK-DFL): block axis first, then the ``N_b`` samples of the block, every member's samples dealt
  round-robin (own samples first), padding rows masked. Called inside the round's ``jit``.
  """

  def __call__(
    self,
    params: Any,
    x: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    lr: jax.Array,
    *client_args: Any,
  ) -> Any:
    """Args:
      params: the client's linearisation point ``w̄_i`` (its neighbourhood average, or its own weights
        without per-round averaging); leaves without the client axis.
      x: ``[m1, N_b, *in]`` the neighbourhood's inputs.
      targets: ``[m1, N_b, C]`` float32 hard one-hot labels.
      mask: ``[m1, N_b]`` bool, True for real samples.
      lr: float32 scalar, the round's learning rate ``η·exp(−decay·r)``.
      *client_args: the caller's per-client arguments (their client axis removed).

    Returns:
      Any pytree; ``run`` stacks the clients' outputs ``[M, ...]`` (NTK-DFL: ``(new params, {'tau', 'loss'})``).
    """


class TargetsFn(Protocol):
  """The evolution-targets hook of NTK-DFL's client update (:func:`ntk_fl.algorithms.ntk_dfl.make_client_update`)."""

  def __call__(self, f0: jax.Array, hard: jax.Array) -> jax.Array:
    """Args: f0: ``[N_b, C]`` the block's starting outputs (logits of the network the evolution starts
    from); hard: ``[N_b, C]`` its hard one-hot labels. Returns: the ``[N_b, C]`` targets to evolve towards
    (identity: ``hard``, NTK-DFL itself)."""


class Replicable(NamedTuple):
  """A method's round with every per-run array an argument: what a seed-batched run maps over its seeds.

  Attributes:
    step: ``step(state, inputs, data) -> (state, metrics)``, pure and *not* jitted; ``Algorithm.step(state,
      inputs)`` is ``jax.jit(step)(state, inputs, data)``. Everything that differs between two seeds of the
      same config (the federation's rows, per-client sizes and package bits) is in ``data``, never closed
      over, so one compiled program serves every seed.
    data: the run's arrays ``step`` reads (a pytree of device arrays of fixed shapes).
  """

  step: Callable[[Any, Any, Any], tuple[Any, dict]]
  data: Any


class ScoreFn(Protocol):
  """The scoring hook of NTK-DFL's client update (:func:`ntk_fl.algorithms.ntk_dfl.make_client_update`).

  Every ``τ`` of the grid gives a candidate; the one of lowest score is kept (first on ties, NaN never).
  """

  def __call__(self, logits: jax.Array, hard: jax.Array, mask: jax.Array) -> jax.Array:
    """Args: logits: ``[N_b, C]`` one candidate's outputs on the block: the candidate network's
    ``f(w + Δw_τ; x_b)`` (``select='network'``) or the evolved ``f_τ`` (``select='linearized'``); hard:
    ``[N_b, C]`` the block's hard one-hot labels; mask: ``[N_b]`` bool, True for real samples (padding
    rows hold zeros: leave them out). Returns: a float scalar, lower is better (NTK-DFL itself:
    ``evolve.mean_loss(logits, hard, mask, loss)``)."""


class Algorithm(NamedTuple):
  """A federated method as a bundle of pure functions (see the module docstring for each one's contract).

  Attributes:
    init: :class:`InitFn`, ``init(key) -> state``.
    round_inputs: :class:`RoundInputsFn`, ``round_inputs(r) -> inputs`` (host side).
    step: :class:`StepFn`, ``step(state, inputs) -> (state, metrics)`` (jit-compiled by the factory).
    client_params: :class:`ClientParamsFn`, ``client_params(state) -> params [M, ...]``.
    aggregate: what evaluation's aggregated model is, one of :data:`AGGREGATES`.
    replicable: :class:`Replicable` (the step with its data as an argument), or ``None``: the method
      refuses ``config.replicas > 1``.
  """

  init: InitFn
  round_inputs: RoundInputsFn
  step: StepFn
  client_params: ClientParamsFn
  aggregate: str = "params"
  replicable: Replicable | None = None


class RunOptions(NamedTuple):
  """What a factory reads of the run settings (:func:`run_options`)."""

  seed: int
  mixing: str
  shared_init: bool
  rounds: int | None


def run_options(
  run,
  method: str,
  topology=None,
  *,
  needs_topology: bool = True,
  seed: int | None = None,
  mixing: str | None = None,
  shared_init: bool | None = None,
  rounds: int | None = None,
) -> RunOptions:
  """A factory's run options: from ``run`` (:class:`ntk_fl.settings.RunSettings`) or from keywords.

  Factories take ``(model, federation, topology, hparams, run)`` (:class:`ntk_fl.algorithms.MakeFn`) and,
  for callers without run settings, the keywords (defaults: seed 0, ``'uniform'`` mixing, a shared
  initialisation). Giving both is an error, as is a missing topology for a method that mixes over one
  (its ``Method`` was registered without ``graph=True``, so the schema built none).
  """
  given = {
    k: v
    for k, v in dict(seed=seed, mixing=mixing, shared_init=shared_init, rounds=rounds).items()
    if v is not None
  }
  if needs_topology and topology is None:
    raise ValueError(
      f"{method} mixes over a communication topology but got none: register its Method with "
      "graph=True (the schema then builds config.topology), or pass a Topology"
    )
  if run is None:
    return RunOptions(**{**dict(seed=0, mixing="uniform", shared_init=True, rounds=None), **given})
  if given:
    raise TypeError(f"{method}: pass the run settings or the keywords {sorted(given)}, not both")
  return RunOptions(
    seed=run.seed, mixing=run.topology.mixing, shared_init=run.model.shared_init, rounds=run.rounds
  )


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
    elif "" not in rests:  # drop below this key, keep the key
      out[key] = config_without(value, *rests)
  return out


def parse_enums(hparams: Any, path: str = "config.algorithm") -> None:
  """Turns the string values of ``hparams``' enum-typed fields into members (in ``__post_init__``).

  The config boundary (:func:`ntk_fl.settings.from_mapping`) converts them already; this does the same for
  a hyperparameter dataclass built in Python with strings (``NTKDFLHParams(loss='mse', ...)``), so the
  factories compare members only. A value that is no member is an error naming the field and the choices.
  """
  import enum  # pylint: disable=import-outside-toplevel
  import typing  # pylint: disable=import-outside-toplevel

  if not dataclasses.is_dataclass(hparams):  # e.g. a namespace of already-checked values
    return
  hints = typing.get_type_hints(type(hparams))
  for field in dataclasses.fields(hparams):
    kind = hints.get(field.name)
    value = getattr(hparams, field.name)
    if isinstance(kind, type) and issubclass(kind, enum.Enum) and not isinstance(value, kind):
      try:
        object.__setattr__(hparams, field.name, kind(value))
      except ValueError:
        raise ValueError(
          f"{path}.{field.name} must be one of {tuple(m.value for m in kind)}, got {value!r}"
        ) from None


def check_evolution(hparams: Any, path: str = "config.algorithm") -> None:
  """Checks the NTK-evolution fields every NTK method's hyperparameters share (once, on construction).

  ``lr`` (> 0), ``lr_decay`` (>= 0, ``η_r = η·exp(−decay·r)``), ``taus`` (see
  :func:`ntk_fl.evolve.check_taus`), the enum fields (``solver: Solver``, ``select: Select``, ``kernel:
  Kernel`` and, where the dataclass has it, ``loss: Loss``; strings become members, :func:`parse_enums`),
  and that the ODE solver is for cross-entropy only.
  """
  from ntk_fl import validation  # pylint: disable=import-outside-toplevel -- base stays light to import
  from ntk_fl._src.options import check_loss_solver, check_taus  # pylint: disable=import-outside-toplevel

  parse_enums(hparams, path)
  validation.check_real(f"{path}.lr", hparams.lr, low=0, low_open=True)
  validation.check_real(f"{path}.lr_decay (η_r = η·exp(−decay·r))", hparams.lr_decay, low=0)
  try:
    check_taus(tuple(hparams.taus))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}.taus: {e}") from e
  if hasattr(hparams, "loss"):
    try:
      check_loss_solver(hparams.loss, hparams.solver)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None


# ------------------------------------------------------------------ the registry of methods


class MakeFn(Protocol):
  """``make(model, federation, topology, hparams, run) -> Algorithm``: a method's factory."""

  def __call__(
    self, model: Any, federation: Any, topology: Any, hparams: Any, run: Any
  ) -> Algorithm:
    """Args:
      model: the :class:`ntk_fl.models.Model`.
      federation: the stacked client data, a :class:`ntk_fl.data.Federation` of ``M`` clients.
      topology: the run's :class:`ntk_fl.topology.Topology` when the method's ``graph`` is set, else None.
      hparams: the method's hyperparameter dataclass, checked (enum fields are members).
      run: the checked :class:`ntk_fl.settings.RunSettings` (seed, rounds, ``topology.mixing``,
        ``model.shared_init``).

    Returns:
      The method's :class:`Algorithm`, its ``step`` jit-compiled.
    """


class Method(NamedTuple):
  """A registered federated method: its factory, its typed hyperparameters and the rules of its config.

  Attributes:
    make: :class:`MakeFn`; a public factory such as ``ntk_dfl.make_ntk_dfl`` is registered as is.
    hyperparameters: the frozen dataclass of ``config.algorithm`` (a subclass may add fields: they are set
      like any other, ``--config.algorithm.<field>=...`` included).
    check: ``check(hparams, run)``, rules across blocks (raises ``ValueError``), or None.
    graph: the method mixes over ``config.topology``: ``make`` receives the run's topology (else None).
    shared_rounds: ``shared_rounds(stored, current) -> int`` for branching from a run (module docstring).
    replicas: the method's :class:`~ntk_fl.algorithms.base.Algorithm` has a ``replicable`` step, so it
      runs seed-batched (``config.replicas > 1``); the others refuse it when the config is checked.
    ntk: an NTK method's client step and kernels (``ntk_fl._src.ntk_step.NTK_FUNCTIONS``), which the
      runner's cost estimate compiles before round 1; None for the methods that train by gradient steps.
  """

  make: MakeFn
  hyperparameters: type
  check: Callable[[Any, Any], None] | None = None
  graph: bool = False
  shared_rounds: Callable[[dict, dict], int] | None = None
  replicas: bool = False
  ntk: Any = None


# name -> "module" defining METHOD or "module:ATTR" (imported on first use), or a registered Method.
_REGISTRY: dict[str, str | Method] = {
  "ntk_dfl": "ntk_fl.algorithms.ntk_dfl",
  "fedavg": "ntk_fl.algorithms.fedavg",
  "fedprox": "ntk_fl.algorithms.fedprox",
  "fedbe": "ntk_fl.algorithms.fedbe",
  "fednova": "ntk_fl.algorithms.fednova",
  "datashare": "ntk_fl.algorithms.datashare",
  "centralized": "ntk_fl.algorithms.centralized",
  "dpsgd": "ntk_fl.algorithms.dpsgd",
  "dfedavg": "ntk_fl.algorithms.dfedavg",
  "dfedavgm": "ntk_fl.algorithms.dfedavgm",
  "dfedsam": "ntk_fl.algorithms.dfedsam",
  "dispfl": "ntk_fl.algorithms.dispfl",
  "ntk_fl": "ntk_fl.algorithms.server_ntk",
  "spark": "ntk_fl.algorithms.spark",
  "fed_ensemble": "ntk_fl.algorithms.fed_ensemble",
  "fedcom": "ntk_fl.algorithms.fedcom",
  "qsgd": "ntk_fl.algorithms.qsgd",
}


def register(name: str, method: Method) -> None:
  """Registers ``method`` under ``name`` (overwrites an existing entry)."""
  if not isinstance(method, Method):
    raise TypeError(
      f"register expects a Method(make, hyperparameters, ...), got {type(method).__name__}"
    )
  if not callable(method.make):
    raise TypeError(
      f"Method.make of {name!r} must be a factory make(model, federation, topology, hparams, "
      f"run), got {method.make!r}"
    )
  _REGISTRY[name] = method


def available() -> list[str]:
  return sorted(_REGISTRY)


def get_method(name: str) -> Method:
  """Returns the :class:`Method` registered as ``name``; a clear error lists the choices."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown method {name!r}; available methods: {', '.join(available())}")
  entry = _REGISTRY[name]
  if isinstance(entry, str):  # "module" (its METHOD) or "module:ATTR"
    module, _, attr = entry.partition(":")
    entry = getattr(importlib.import_module(module), attr or "METHOD")
    _REGISTRY[name] = entry
  return entry
