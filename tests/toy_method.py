"""A tiny decentralised method for runner tests: ``toy_gd``.

Every round each client takes one full-batch gradient step on a random 80%
of its samples (a per-round PRNG key, so resume must replay round inputs
exactly), then averages uniformly with its neighbours on the configured
topology (a static ring in ``tests/configs/toy.py``). Importing this module
registers it; configs name it through ``config.method_module``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import algorithms, models, topology
from ntk_fl.algorithms import Algorithm, Method
from ntk_fl.parallel import for_each_client

__all__ = ["METHOD", "ToyHParams", "ToyState"]


class ToyState(NamedTuple):
  params: Any  # stacked [M, ...]
  steps: Any  # int32 scalar: rounds taken (checks that non-parameter leaves survive a checkpoint)


class ToyInputs(NamedTuple):
  neighbors: Any  # [M, k_max] int32
  self_weight: Any  # [M] float32
  neighbor_weights: Any  # [M, k_max] float32
  lr: Any  # float32 scalar
  key: Any  # PRNG key of the round


@dataclasses.dataclass(frozen=True)
class ToyHParams:
  lr: float  # round r uses lr * 0.9**r

  def __post_init__(self):
    if not isinstance(self.lr, float) or not self.lr > 0:
      raise ValueError(f"config.algorithm.lr must be a float > 0, got {self.lr!r}")


def make(
  model: models.Model, federation, topo: topology.Topology, hparams: ToyHParams, run
) -> Algorithm:
  num_clients = federation.x.shape[0]
  x, y, mask = (jnp.asarray(a) for a in (federation.x, federation.y, federation.mask))

  def init(key):
    return ToyState(models.init_clients(model, key, num_clients), jnp.int32(0))

  def round_inputs(r: int) -> ToyInputs:
    graph = topo.sample(r)
    self_w, nbr_w = topology.mixing_weights(graph, run.topology.mixing)
    lr = np.float32(hparams.lr * 0.9**r)
    return ToyInputs(
      graph.neighbors, self_w, nbr_w, lr, jax.random.fold_in(jax.random.PRNGKey(run.seed), r)
    )

  def local(params, x, y, mask, key, lr):
    keep = mask & jax.random.bernoulli(key, 0.8, mask.shape)

    def loss_fn(p):
      logits = model.apply(p, x)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1)[:, 0]
      return jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.maximum(jnp.sum(keep), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, g: w - lr * g, params, grads), loss, jnp.sum(keep)

  def step(state: ToyState, inputs: ToyInputs):
    keys = jax.random.split(inputs.key, num_clients)
    lr = jnp.broadcast_to(inputs.lr, (num_clients,))
    params, loss, kept = for_each_client(local)(state.params, x, y, mask, keys, lr)

    def mix(w):
      nbr = jnp.einsum("mk,mk...->m...", inputs.neighbor_weights, w[inputs.neighbors])
      return inputs.self_weight.reshape(-1, *([1] * (w.ndim - 1))) * w + nbr

    new = ToyState(jax.tree.map(mix, params), state.steps + 1)
    return new, {"loss": loss, "kept": kept, "lr": inputs.lr}

  # The factory compiles its step (the contract of Algorithm.step); the toy data are tiny, so closing over
  # them as constants is fine here -- real methods pass the federation as jit arguments.
  return Algorithm(
    init=init, round_inputs=round_inputs, step=jax.jit(step), client_params=lambda s: s.params
  )


METHOD = Method(make=make, hyperparameters=ToyHParams, graph=True)
algorithms.register("toy_gd", METHOD)
