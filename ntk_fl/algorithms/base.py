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
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

__all__ = ["Algorithm"]


class Algorithm(NamedTuple):
  init: Callable[[Any], Any]
  round_inputs: Callable[[int], Any]
  step: Callable[[Any, Any], tuple[Any, dict]]
  client_params: Callable[[Any], Any]
