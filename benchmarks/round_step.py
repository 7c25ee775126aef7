"""Compile and run time of one method's round step, alone (no evaluation, no checkpoints).

  .venv/bin/python benchmarks/round_step.py fed_ensemble:smoke,cnn
  .venv/bin/python benchmarks/round_step.py fed_ensemble:smoke,cnn --plain-gradient

Builds the run with ``runner.build_experiment``, compiles ``algorithm.step`` on round 0's inputs and
runs it ``--repeats`` times from the same state. ``--plain-gradient`` makes local training take
``jax.value_and_grad`` of the minibatch loss for every model (no convolution weight gradients from
input patches: ``local.patch_apply`` returns ``None``), the code before that change, for a back-to-back
comparison; ``--save`` writes the new state's float leaves (``.npy``) to compare the two.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from ntk_fl import runner
from ntk_fl.algorithms import local
from ntk_fl.config import load_config


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("config", help="<method>:<variants>, e.g. fed_ensemble:smoke,cnn")
  parser.add_argument("--plain-gradient", action="store_true")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--save", default="")
  args = parser.parse_args()
  method, _, variants = args.config.partition(":")
  if args.plain_gradient:
    local.patch_apply = lambda model: None
  exp = runner.build_experiment(load_config(f"ntk_fl/configs/{method}.py", variants))
  with exp.device_policy():
    algorithm = exp.algorithm
    state = algorithm.init(jax.random.key(0))
    inputs = algorithm.round_inputs(0)
    start = time.perf_counter()
    step = jax.jit(algorithm.step).lower(state, inputs).compile()
    print(f"{args.config} compile {time.perf_counter() - start:.1f} s", flush=True)
    for _ in range(args.repeats):
      start = time.perf_counter()
      out = jax.block_until_ready(step(state, inputs))
      print(f"{args.config} step {time.perf_counter() - start:.1f} s", flush=True)
  if args.save:
    leaves = [np.asarray(a) for a in jax.tree.leaves(out[0]) if hasattr(a, "dtype")]
    floats = [a.ravel().astype(np.float64) for a in leaves if np.issubdtype(a.dtype, np.floating)]
    np.save(args.save, np.concatenate(floats))


if __name__ == "__main__":
  main()
