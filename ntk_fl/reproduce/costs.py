"""Per-round cost of each method at the paper scale, and the time estimate of a run from its config.

One table, :data:`ROUND_SECONDS`, holds the measured (or, where marked, assumed)
seconds per round at the NTK papers' scale -- 300 clients of ≈ 200 Fashion-MNIST
samples, MLP 784-100-10, 5-regular graphs, τ ≤ 800 (NTK-FL family: 20 clients per
round) -- on the 2-core AMD EPYC (both cores) and on one NVIDIA H100, each with its
source. :func:`estimate` scales a row to a config: linearly in the clients and the
rounds, and for the NTK methods with the square of the neighbourhood's sample
count (the Euler evolution through the ``[N, N]`` kernel is ≈ 95 % of an NTK-DFL
round, benchmarks/RESULTS.md) and linearly in the largest τ. The neighbourhood is
counted as every client's block is laid out: padded to the topology's neighbour
slots (``k_max``), which for an Erdős–Rényi graph is its degree bound, not its mean
degree. A block that outgrows the caches may run slower than this scaling says. DataShare's
participants train on their own samples plus the shared set, so its round scales with
``1 + share_fraction × clients``.
A gossip NTK run that transmits explicit, compressed Jacobians (top-k or b-bit quantisation,
NTK-DFL App. E.3, with or without the input projection) is dominated by building, compressing and
contracting those Jacobians instead: its row is the measured compressed round
(:data:`TRANSMITTED_ROUND`), scaled with the Jacobians' size (clients × neighbourhood samples ×
parameters of the network on the transmitted inputs). The input projection alone keeps the round
matrix-free, so it is costed (and grouped by degree) as the uncompressed round. The estimates are
for planning a queue; a run stopped at a target accuracy takes at most that long.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ntk_fl import settings, topology
from ntk_fl.algorithms.base import get_method

__all__ = ["Cost", "ROUND_SECONDS", "TRANSMITTED_ROUND", "estimate", "markdown_table"]


class Cost(NamedTuple):
  """Seconds per round at the paper scale; ``gpu`` is ``None`` where no GPU measurement exists.

  ``cpu_eval`` is the part of ``cpu`` spent scoring the models, which does not scale with the
  neighbourhood.
  """

  cpu: float
  gpu: float | None
  source: str
  cpu_eval: float = 0.0


ROUND_SECONDS: dict[str, Cost] = {
  "ntk_dfl": Cost(
    62.5,
    0.76,
    "benchmarks/RESULTS.md, NTK-DFL round: 58.5 s step (chunk 1, commit 90d12b4) "
    "+ 4.0 s evaluation; GPU: 0.763 s step on one H100, all clients in one vmap (commit 6fb8dae)",
    4.0,
  ),
  "spark": Cost(
    92.0,
    0.73,
    "benchmarks/RESULTS.md: ≈ 92 s per SPARK round on one core of the AMD EPYC; GPU: "
    "0.725 s step on one H200, all clients in one vmap (commit cd8afc1; at chunk 1, 4.98 s on an H100)",
    4.0,
  ),
  "dfedavg": Cost(
    11.0,
    0.081,
    "benchmarks/RESULTS.md, DFedAvg round: 11.0 s at chunk 30 (loaded); GPU: 0.081 s on one H100",
  ),
  "dfedavgm": Cost(
    11.0, None, "assumed equal to DFedAvg (20 local epochs; batch 50 means fewer steps)"
  ),
  "dfedsam": Cost(
    11.0, None, "assumed equal to DFedAvg (5 epochs of batch 32 at two gradients per SAM step)"
  ),
  "dispfl": Cost(
    20.8, None, "benchmarks/RESULTS.md, DisPFL round: 20.8 s at chunk 30 (commit 58e5b80, loaded)"
  ),
  "dpsgd": Cost(
    3.6,
    None,
    "docs/REPRODUCTION.md, NTK-DFL Fig. 10b's D-PSGD (MNIST, 100 rounds, commit f0b1943): median "
    "2.9 s step + 0.74 s evaluation per round on one core of the loaded 2-core AMD EPYC",
    0.74,
  ),
  "ntk_fl": Cost(
    21.0,
    None,
    "docs/REPRODUCTION.md, NTK-FL seeds 1-2: 18-24 s per round on one core (20 clients per round)",
  ),
  "cp_ntk_fl": Cost(20.0, None, "docs/ntk_fl.md, CP-NTK-FL table1 runs: 16-25 s per round"),
  "fedavg": Cost(
    0.55,
    None,
    "NTK-FL Fig. 5's FedAvg runs (50 rounds, α = 0.2-0.5, commit 2997b23): median 0.50-0.53 s step "
    "+ 0.02 s evaluation per round on one core of the loaded 2-core AMD EPYC with AVX-512 (0.97 s "
    "at α = 0.1, more loaded)",
    0.02,
  ),
  "fednova": Cost(
    0.52,
    None,
    "NTK-FL Fig. 5's FedNova runs (50 rounds, commit 2997b23): median 0.50 s step + 0.02 s "
    "evaluation per round on one core of the loaded 2-core AMD EPYC with AVX-512",
    0.02,
  ),
  "fedprox": Cost(0.55, None, "assumed as FedAvg (one more term in the local gradient)", 0.02),
  "datashare": Cost(
    16.3,
    None,
    "NTK-FL Fig. 5's DataShare runs at α = 0.1 and 0.5 (50 rounds, commit 2997b23): median 16.3 s "
    "step + 0.02 s evaluation per round on one core of the 2-core AMD EPYC with AVX-512, the other "
    "core running another run; each participant trains on its ≈ 200 samples plus the 6,000 shared "
    "ones, 31x FedAvg's minibatches (30x its measured round)",
    0.02,
  ),
  "centralized": Cost(
    0.41,
    None,
    "NTK-FL Fig. 5's centralized run at α = 0.1 (50 rounds, commit 2997b23): median 0.39 s step + "
    "0.02 s evaluation per round on one core of the loaded 2-core AMD EPYC with AVX-512",
    0.02,
  ),
  "fed_ensemble": Cost(1.0, None, "assumed: 10 of 100 clients per round, 2 epochs of batch 50"),
  "qsgd": Cost(
    0.56,
    None,
    "docs/REPRODUCTION.md, QSGD α = 0.1 seed 0 (575 rounds, commit 95e7808): 0.34 s step + 0.22 s "
    "evaluation per round on one core of the loaded 2-core AMD EPYC",
    0.22,
  ),
  "fedcom": Cost(
    3.3,
    None,
    "docs/REPRODUCTION.md, FedCOM α = 0.1 seed 0 (170 rounds, commit 95e7808): 3.2 s step + 0.11 s "
    "evaluation per round (medians) on one core of the loaded 2-core AMD EPYC (1.3 s step when "
    "less loaded)",
    0.11,
  ),
  "fedbe": Cost(
    3.3,
    None,
    "docs/REPRODUCTION.md, FedBE seed 0: median 3.3 s step over 200 rounds on the loaded 2-core AMD "
    "EPYC (10 clients' local training, 21-model soft labels on 5,000 samples, 780 distillation steps)",
  ),
}

# The gossip NTK round on explicit, compressed Jacobians, measured on `ntk_dfl:compressed` (top-k 0.5,
# 6 bits, m2 = 5, d1' = 200): 240 samples per neighbourhood, 21,110 parameters of the MLP on d1'-wide inputs.
TRANSMITTED_ROUND = Cost(
  4.6 * 62.5,
  None,
  "benchmarks/RESULTS.md, compressed NTK-DFL: a 300-client `ntk_dfl:compressed` round 940 s against an "
  "uncompressed one's 206.5 s, back to back on the loaded 2-core AMD EPYC (4.6x), times the idle "
  "NTK-DFL row",
  4.0,
)
_TRANSMITTED_SAMPLES = 240  # per neighbourhood in the measured config
_TRANSMITTED_PARAMS = 200 * 100 + 100 + 100 * 10 + 10

_NTK_GOSSIP = ("ntk_dfl", "spark")
_NTK_SERVER = ("ntk_fl", "cp_ntk_fl")
# Where a method has no GPU measurement, its CPU time is divided by the measured CPU/GPU ratio of
# its family.
_GPU_RATIO_NTK = ROUND_SECONDS["ntk_dfl"].cpu / ROUND_SECONDS["ntk_dfl"].gpu
_GPU_RATIO_GRADIENT = ROUND_SECONDS["dfedavg"].cpu / ROUND_SECONDS["dfedavg"].gpu


def _built_topology(config: dict) -> topology.Topology:
  # Neither the slot count nor the degree spread depends on the seed.
  return topology.topology_from_fields(config["topology"], config["data"]["num_clients"], seed=0)


def _neighbour_slots(config: dict) -> int:
  """Neighbour slots each client's NTK block is padded to: the topology's ``k_max``.

  A regular, ring, line, complete or clustered graph fills its slots; an Erdős–Rényi graph's are
  its degree bound (22 for 300 clients at mean degree 5), far above its mean degree, and every
  client's block is padded to them unless the round groups clients by degree
  (:func:`_mean_squared_members`).
  """
  return _built_topology(config).k_max


def _any_slot_count(config: dict) -> bool:
  """The method's own ``any_slot_count`` (NTK-DFL's and SPARK's hyperparameters): whether its client
  update fits a neighbourhood of any slot count."""
  spec = get_method(config["method"])
  hparams = settings.from_mapping(spec.hyperparameters, config["algorithm"], "config.algorithm")
  return bool(getattr(hparams, "any_slot_count", False))


def groups_by_degree(config: dict, built: topology.Topology | None = None) -> bool:
  """Whether ``config``'s NTK round gives each client its degree group's slots instead of ``k_max``.

  A round mapped in chunks (``1 <= chunk_size < M``) on a topology whose degrees spread
  (:func:`ntk_fl.topology.degree_slot_groups`), of a method whose update fits any slot count (NTK-DFL
  uncompressed, SPARK uncompressed with Option A). ``built``: the config's topology, if at hand.
  """
  if config["method"] not in _NTK_GOSSIP:
    return False
  built = _built_topology(config) if built is None else built
  return (
    1 <= config.get("chunk_size", 0) < config["data"]["num_clients"]
    and len(topology.degree_slot_groups(built)) > 1
    and _any_slot_count(config)
  )


def _mean_squared_members(config: dict) -> float:
  """The mean over clients of ``(1 + slots)²``, the NTK work of a neighbourhood of that many members.

  Padded: ``(1 + k_max)²``. Grouped by degree: each client's group's slots in the round-0 graph of
  seed 0 (the degrees of other rounds and seeds spread alike).
  """
  built = _built_topology(config)
  if not groups_by_degree(config, built):
    return float((1 + built.k_max) ** 2)
  return float(np.mean((1 + built.client_slots(built.sample(0))) ** 2))


def transmits_jacobians(config: dict) -> bool:
  """Whether ``config`` is a gossip NTK run whose clients send explicit, compressed Jacobians.

  Top-k or quantisation (``NTKDFLHParams.compressed``); the input projection alone does not: its round
  stays matrix-free (the model on ``d1'`` inputs, docs/ntk_dfl.md).
  """
  algo = config.get("algorithm", {})
  return config["method"] in _NTK_GOSSIP and (
    algo.get("sparsify_keep", 1.0) < 1 or algo.get("quantize_bits", 32) < 32
  )


def _row(config: dict) -> Cost:
  return TRANSMITTED_ROUND if transmits_jacobians(config) else ROUND_SECONDS[config["method"]]


def round_scale(config: dict) -> float:
  """How much one round of ``config`` costs relative to its row (:data:`ROUND_SECONDS`, or
  :data:`TRANSMITTED_ROUND` where :func:`transmits_jacobians`)."""
  data, algo = config["data"], config.get("algorithm", {})
  clients = data["num_clients"] / 300
  samples = data.get("samples_per_client", 200) / 200
  method = config["method"]
  if transmits_jacobians(config):
    neighbourhood = (_neighbour_slots(config) + 1) * 200 * samples / algo.get("subsample", 1)
    inputs = algo.get("projection_dim", 0) or 784
    params = inputs * 100 + 100 + 100 * 10 + 10
    return clients * neighbourhood / _TRANSMITTED_SAMPLES * params / _TRANSMITTED_PARAMS
  if method in _NTK_GOSSIP:
    per_client = _mean_squared_members(config) / 36 * (samples / algo.get("subsample", 1)) ** 2
    per_client /= algo.get("jacobian_batches", 1)
    return clients * per_client * max(algo.get("taus", (800,))) / 800
  if method in _NTK_SERVER:
    pooled = (algo.get("clients_per_round", 20) or data["num_clients"]) / 20 * samples
    pooled *= algo.get("subsample_fraction", 1.0)
    return max(pooled**2, 0.05) * max(algo.get("taus", (2000,))) / 2000
  if method in ("dfedavg", "dfedavgm", "dfedsam", "dispfl", "dpsgd"):
    return clients * samples
  if method == "datashare":
    # Each participant's epochs run over its own samples plus the shared set (share_fraction of all
    # clients' samples): minibatches grow with 1 + share_fraction x clients (31 at the paper's row).
    share = algo.get("share_fraction", 0.1) * data["num_clients"]
    return samples * (1 + share) / (1 + 0.1 * 300)
  return 1.0  # server baselines: a fixed number of participants per round


def estimate(config: dict) -> tuple[float, float, bool]:
  """``(cpu_seconds, gpu_seconds, gpu_measured)`` of a whole run of the stored-form ``config``.

  Raises:
    ValueError: the method has no row in :data:`ROUND_SECONDS`.
  """
  method = config["method"]
  if method not in ROUND_SECONDS:
    raise ValueError(
      f"no per-round cost for method {method!r}; add it to ntk_fl.reproduce.costs.ROUND_SECONDS "
      f"(known: {', '.join(sorted(ROUND_SECONDS))})"
    )
  cost = _row(config)
  scale, rounds = round_scale(config), config["rounds"]
  cpu = ((cost.cpu - cost.cpu_eval) * scale + cost.cpu_eval) * rounds
  if cost.gpu is not None:
    return cpu, cost.gpu * scale * rounds, True
  ratio = _GPU_RATIO_NTK if method in _NTK_GOSSIP + _NTK_SERVER else _GPU_RATIO_GRADIENT
  return cpu, cost.cpu / ratio * scale * rounds, False


def markdown_table() -> str:
  """:data:`ROUND_SECONDS` as a markdown table (docs/REPRODUCTION.md shows it)."""
  rows = [
    "| method | s/round, 2-core AMD EPYC | s/round, one H100 | source |",
    "|---|---:|---:|---|",
  ]
  for method, cost in ROUND_SECONDS.items():
    gpu = f"{cost.gpu:g}" if cost.gpu is not None else "—"
    rows.append(f"| {method} | {cost.cpu:g} | {gpu} | {cost.source} |")
  return "\n".join(rows)
