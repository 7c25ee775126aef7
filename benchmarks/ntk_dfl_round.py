"""Time one paper-scale NTK-DFL round and break it down.

  .venv/bin/python benchmarks/ntk_dfl_round.py                 # 300 clients, κ=5, τ ∈ {100..800}, real FMNIST
  .venv/bin/python benchmarks/ntk_dfl_round.py --clients 60 --repeats 1

Stages, each jit-compiled and timed separately (steady state, after a compile
call), every one over all clients through the same ``for_each_client`` chunking
as the algorithm:

* ``average``  -- eq. (1) neighbour averaging of the stacked parameters;
* ``kernel``   -- gathering each neighbourhood and its structured NTK;
* ``evolve``   -- kernel + the Euler cross-entropy evolution over the τ grid;
* ``step``     -- the whole round (adds the VJP weight updates for every τ and
  the τ selection by the non-linear network's loss);
* ``evaluate`` -- the runner's per-round evaluation (aggregated model + every
  client on the 10k test set).

Prints a markdown table (seconds) with the machine; paste it into
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _timing import time_calls  # noqa: E402

from ntk_fl import evolve, gossip, ntk, parallel, runner  # noqa: E402
from ntk_fl import metrics as metrics_lib  # noqa: E402


def _config(args):
  from ntk_fl.config import load_config  # pylint: disable=import-outside-toplevel

  config = load_config(
    os.path.join(os.path.dirname(__file__), "..", "configs", "ntk_dfl.py"), args.variant
  )
  config.data.num_clients = args.clients
  config.topology.degree = args.degree
  config.chunk_size = args.chunk
  config.algorithm.taus = tuple(range(100, args.tau_max + 1, 100))
  if args.max_train:
    config.data.max_train = args.max_train
  return config


def _timed(fn, *args, repeats):
  """Best of ``repeats`` calls after the compiling one."""
  return time_calls(fn, *args, repeats=repeats).best


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--clients", type=int, default=300)
  parser.add_argument("--degree", type=int, default=5)
  parser.add_argument("--chunk", type=int, default=30, help="clients per vmap chunk (0 = all)")
  parser.add_argument("--tau-max", type=int, default=800)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--variant", default="")
  parser.add_argument("--max-train", type=int, default=0)
  parser.add_argument(
    "--skip-stages", action="store_true", help="time only the whole step and evaluation"
  )
  args = parser.parse_args()

  config = _config(args)
  experiment = runner.build_experiment(config)
  algorithm, model, fed = experiment.algorithm, experiment.model, experiment.federation
  state = algorithm.init(jax.random.key(config.seed))
  inputs = algorithm.round_inputs(0)
  algo = config.algorithm
  rows = []

  with (
    experiment.device_policy()
  ):  # the config's devices and chunk size, read when a step is traced
    step_time = _timed(algorithm.step, state, inputs, repeats=args.repeats)
    if not args.skip_stages:
      data = jax.device_put(fed)

      @jax.jit
      def average(params, inputs):
        return gossip.mix(params, inputs.neighbors, inputs.self_weight, inputs.neighbor_weights)

      def neighbourhood(idx, nbrs, nbr_mask, data):
        members = jnp.concatenate([idx[None], nbrs])
        mask = data.mask[members] & jnp.concatenate([jnp.ones((1,), bool), nbr_mask])[:, None]
        x, y = data.samples(data.index[members].reshape(-1))
        targets = jax.nn.one_hot(y, model.num_classes)
        return x, targets, mask.reshape(-1)

      def make_stage(with_evolution):
        @jax.jit
        def stage(params, inputs, data):
          def per_client(p, idx, nbrs, nbr_mask):
            x, targets, mask = neighbourhood(idx, nbrs, nbr_mask, data)
            x = jnp.where(mask[:, None], x, 0.0)
            kernel = ntk.empirical_ntk(model.apply, p, x, dense_stack=model.dense_stack)
            if not with_evolution:
              return kernel[0, :4]
            evo = evolve.evolve(
              kernel,
              model.apply(p, x),
              targets,
              mask,
              lr=algo.lr,
              taus=tuple(algo.taus),
              loss="ce",
              solver=algo.solver,
            )
            return evo.residual_sums[:, 0, :]

          return parallel.for_each_client(per_client)(
            params, jnp.arange(fed.n.shape[0]), inputs.neighbors, inputs.neighbor_mask
          )

        return stage

      rows.append(("average (eq. 1)", _timed(average, state.params, inputs, repeats=args.repeats)))
      kernel_time = _timed(make_stage(False), state.params, inputs, data, repeats=args.repeats)
      evolve_time = _timed(make_stage(True), state.params, inputs, data, repeats=args.repeats)
      rows.append(("neighbourhood gather + structured NTK", kernel_time))
      rows.append(("Euler CE evolution (τ_max steps)", evolve_time - kernel_time))
      rows.append(
        ("VJP updates + τ selection (step − the above)", step_time - evolve_time - rows[0][1])
      )
    rows.append(("**whole step**", step_time))

    evaluator = metrics_lib.make_evaluator(
      model.apply,
      experiment.dataset.x_test,
      experiment.dataset.y_test,
      batch_size=config.eval.batch_size,
    )
    rows.append(
      (
        "evaluation (aggregated + all clients)",
        _timed(
          lambda p: (evaluator.aggregate(p), evaluator.clients(p)),
          state.params,
          repeats=args.repeats,
        ),
      )
    )

  peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(
    f"NTK-DFL round: {args.clients} clients, κ={args.degree}, N≈{(args.degree + 1) * fed.index.shape[1]} "
    f"per neighbourhood, τ ≤ {args.tau_max}, chunk {config.chunk_size}, solver {algo.solver}"
  )
  print(
    f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
    f"{jax.devices()[0].platform}; peak RSS {peak_mb:.0f} MB\n"
  )
  print("| stage | seconds |\n|---|---|")
  for name, seconds in rows:
    print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
  main()
