"""Client accuracy two ways, from a decentralized run's checkpoint: own models vs neighbourhood consensus.

  .venv/bin/python experiments/consensus_accuracy.py runs/spark/iid_s0 [runs/spark/alpha0.1_s0 ...] [--round 30]

What a paper calls "client accuracy" is not always the same model. The runner's
``client_acc_mean`` scores each client's *own* model after its round (for SPARK:
``w̄_i + (1+μ) Δw + μ² v``, momentum included). A client that stopped after the
averaging step of the next round would hold its *consensus* model instead,
``w̄_i = Σ_j W_ij w_j`` over its closed neighbourhood, the model NTK-DFL and SPARK
linearise at. SPARK's Table 4 reports client accuracies 0.7–0.8 points under the
aggregated model, where our own-model means sit 2–9 points under it; this script
scores both on the same checkpoint so the two readings can be compared.

For each workdir (a finished or running neighbourhood-method run: NTK-DFL, SPARK
or a dense gossip baseline; DisPFL averages under its sparse masks, which this
plain mixing does not reproduce) it restores the checkpoint after ``--round`` rounds (default:
the latest), mixes the client models with the graph and weights of the round that
follows (``round_inputs(R)``, 0-based, exactly what round ``R + 1`` starts from) and
prints one markdown row per run: the aggregated model, the own models and the
consensus models (mean, min, max test accuracy over clients). The aggregated
accuracy and the own-model mean equal the run's ``metrics.jsonl`` line of that
round when the run scored its clients then. Runs with ``config.eval.consensus``
(SPARK's default) log the consensus accuracy every round
(``consensus_acc_*``); this script serves the runs without it.
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

from ntk_fl import gossip, metrics, rundir, runner
from ntk_fl.checkpoint import Checkpoints


def client_accuracies(
  workdir: str, round_: int | None = None, *, trust_method_module: str | None = None
) -> dict:
  """Aggregated, own-model and consensus-model test accuracies after ``round_`` rounds of the run in ``workdir``.

  Returns:
    ``{"round", "aggregated", "own" [M], "consensus" [M]}`` (accuracies as floats / numpy arrays).
  """
  experiment = runner.build_experiment(
    rundir.rebuild_config(workdir, trust_method_module=trust_method_module)
  )
  algorithm, settings = experiment.algorithm, experiment.settings
  template = algorithm.init(jax.random.key(settings.seed))
  with Checkpoints(rundir.checkpoint_dir(workdir), read_only=True) as checkpoints:
    round_ = checkpoints.latest() if round_ is None else round_
    if round_ is None:
      raise FileNotFoundError(f"{workdir} has no finalised checkpoint")
    state = checkpoints.restore(round_, template)
  own = algorithm.client_params(state)
  consensus = gossip.consensus(own, algorithm.round_inputs(round_))
  with experiment.device_policy():  # the run's devices and chunk size, as the runner evaluated
    evaluator = metrics.make_evaluator(
      experiment.model.apply,
      experiment.dataset.x_test,
      experiment.dataset.y_test,
      batch_size=settings.eval.batch_size,
    )
    aggregated = float(evaluator.aggregate(own)[0])
    own_acc = np.asarray(evaluator.clients(own)[0])
    consensus_acc = np.asarray(evaluator.clients(consensus)[0])
  return {"round": round_, "aggregated": aggregated, "own": own_acc, "consensus": consensus_acc}


def row(name: str, result: dict) -> str:
  spread = lambda a: f"{100 * a.mean():.2f} ({100 * a.min():.1f}–{100 * a.max():.1f})"
  return (
    f"| {name} | {result['round']} | {100 * result['aggregated']:.2f} | {spread(result['own'])} | "
    f"{spread(result['consensus'])} |"
  )


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument(
    "--round", type=int, default=None, help="checkpoint to score (default: the latest)"
  )
  parser.add_argument(
    "--method_module",
    default=None,
    help="a run whose config.json names a method_module (a user's own method) needs it named "
    "here too: a run directory is not trusted to import code on its own",
  )
  args = parser.parse_args()
  print(
    "| run | round | aggregated % | own models: mean (min–max) % | consensus models: mean (min–max) % |"
  )
  print("|---|---:|---:|---:|---:|")
  for workdir in args.workdirs:
    result = client_accuracies(workdir, args.round, trust_method_module=args.method_module)
    print(row(os.path.basename(os.path.normpath(workdir)), result), flush=True)


if __name__ == "__main__":
  main()
