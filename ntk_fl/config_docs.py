"""What each config field means; the packaged configs and their variants (``ntk-fl`` shows them).

:data:`FIELD_DOCS` is the one table of one-line meanings of the config fields:
the shared ones of :func:`ntk_fl.config.base_config` and every method's own
``config.algorithm`` fields (keyed ``algorithm.<name>``; a name several
methods share has one meaning). ``ntk-fl --config=ntk_dfl:smoke --print_config``
prints a resolved config with them (:func:`format_config`);
``ntk-fl --list_configs`` lists the packaged configs and their variants
(:func:`config_variants`, read from each config's ``VARIANTS`` and the
variant list of its docstring, plus :data:`ntk_fl.config.COMMON_VARIANTS`).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any
from collections.abc import Iterator, Mapping

__all__ = [
  "FIELD_DOCS",
  "COMMON_VARIANT_DOCS",
  "config_variants",
  "field_doc",
  "flatten",
  "format_config",
  "format_configs",
]

FIELD_DOCS: dict[str, str] = {
  # ------------------------------------------------------------------ run
  "method": "registered name of the federated method (ntk_dfl, dfedavg, spark, ...)",
  "method_module": "module (dotted name or .py path) imported first, for a user's own registered method",
  "seed": "every random draw of the run (partition, init, graphs, sampling) derives from it",
  "rounds": "communication rounds",
  "checkpoint_every": "rounds between orbax checkpoints (0 = never); the two newest are kept",
  "checkpoint_keep": "1-based rounds whose checkpoints are also written and never deleted (branch points)",
  "on_divergence": "a round with NaN/inf models or losses: 'stop' the run or 'continue' (logged)",
  "chunk_size": "clients per vmap chunk on each device (0 = all at once); memory vs speed, same results",
  "devices": "devices the client axis is sharded over (0 = all, 1 = single-device path, n = first n)",
  "replicas": "seeds seed .. seed+replicas-1 run as one compiled program, one run directory each (1 = one run)",
  "replica_chunk": "replicas vmapped at once (1 = one after another in the program, exact; 0 = all, GPU throughput)",
  "debug_clients": "no jit, clients one by one in a Python loop; an error names the client and the stage",
  "cost_estimate": "NTK methods: compile and time one client step before round 1, log the round's cost (False = skip)",
  # ------------------------------------------------------------------ data
  "data.name": "dataset: fashion_mnist | mnist | emnist_digits | femnist | cifar10 (never downloaded)",
  "data.data_dir": "folder searched first for the dataset's files ('' = $NTK_FL_DATA_DIR, system folders)",
  "data.partition": (
    "split over clients: iid | dirichlet | dirichlet_fixed_size | shards | by_writer | "
    "contiguous | index_map"
  ),
  "data.partition_file": "index_map only: a CSR .npz index map or the name of a shipped one",
  "data.num_clients": "number of clients M",
  "data.alpha": "Dirichlet concentration of dirichlet / dirichlet_fixed_size (small = skewed labels)",
  "data.samples_per_client": (
    "samples per client: iid (0 = all, near-equal), dirichlet_fixed_size and contiguous (0 = N / M)"
  ),
  "data.classes_per_client": "shards only: distinct classes per client",
  "data.keep_per_client": "shards only: each client keeps a random this many of its samples (0 = all)",
  "data.max_train": "random training subset of this size, drawn from the seed (0 = whole training set)",
  "data.max_test": "random test subset of this size, drawn from the seed (0 = whole test set)",
  # ------------------------------------------------------------------ model
  "model.name": "architecture: mlp | cnn",
  "model.hidden": "MLP hidden-layer widths, e.g. (100,) for 784-100-10",
  "model.activation": "hidden-layer nonlinearity (relu, tanh, ...)",
  "model.init": "'shared': one initialisation for every client; 'per_client': independent ones",
  "model.module": (
    "your own flax model: 'package.module:factory' or 'file.py:factory', a "
    "factory(input_shape, num_classes) returning a flax module (trusted code, imported)"
  ),
  "model.per_sample": (
    "whether the model maps samples independently (enables the per-sample "
    "kernel fast path; the library's models are)"
  ),
  # ------------------------------------------------------------------ topology
  "topology.name": (
    "graph of the decentralized methods: regular | erdos_renyi | ring | line | complete | clustered"
  ),
  "topology.degree": "regular only: neighbours per client",
  "topology.p": "erdos_renyi only: edge probability (0 = derive it from mean_degree)",
  "topology.mean_degree": "erdos_renyi only, when p = 0: expected neighbours per client",
  "topology.cluster_size": "clustered only: clique size (cluster_size - 1 neighbours each)",
  "topology.dynamic": "draw a new graph every round (False = one graph for the whole run)",
  "topology.k_max": "static neighbour slots per client (0 = derive from the topology)",
  "topology.mixing": "neighbourhood averaging weights: uniform | data_size | metropolis",
  # ------------------------------------------------------------------ eval
  "eval.every": "rounds between evaluations of the aggregated model",
  "eval.clients_every": "rounds between evaluations of every client's own model (0 = never)",
  "eval.targets": "accuracies for the 'rounds to reach X' summary",
  "eval.selection": "at the end, the best-to-worst client-selection curves (NTK-DFL Fig. 6)",
  "eval.stop_at": "stop after the first round whose aggregated accuracy reaches it (0 = run all rounds)",
  "eval.batch_size": "test samples per evaluation batch",
  "eval.consensus": "decentralized methods: also score each client's consensus (neighbourhood-averaged) model",
  # ------------------------------------------------------------------ algorithm: shared names
  "algorithm.lr": "learning rate η (of round 0, where it decays)",
  "algorithm.lr_decay": "NTK methods: round r uses η·exp(−lr_decay·r) (0 = constant)",
  "algorithm.lr_gamma": "gradient methods: round r uses lr·lr_gamma**r (1 = constant)",
  "algorithm.epochs": "local passes over the client's data per round",
  "algorithm.batch_size": "local minibatch size",
  "algorithm.momentum": "momentum μ of the local optimiser (SPARK: of the per-round NTK update)",
  "algorithm.optimizer": "client optimiser of local training: 'sgd' | 'adam'",
  "algorithm.adam_b1": "Adam's first-moment decay β1 (optimizer='adam')",
  "algorithm.adam_b2": "Adam's second-moment decay β2 (optimizer='adam')",
  "algorithm.adam_eps": "Adam's ε added to the root second moment (optimizer='adam')",
  "algorithm.over_selected": (
    "Fed-ensemble stragglers: clients selected per round, of which the "
    "clients_per_round first to finish are aggregated (0 = off)"
  ),
  "algorithm.latency_sigma": "σ of the log-normal device speed in the straggler latency model",
  "algorithm.validation_clients": (
    "NTK-FL: clients held out of training whose data scores τ (select='validation')"
  ),
  "algorithm.linearise_at": (
    "SPARK: where neighbour Jacobians are taken: 'receiver' (at w̄_i, "
    "Option A) | 'sender' (at each sender's own w̄_j, Option B)"
  ),
  "algorithm.nesterov": "Nesterov momentum",
  "algorithm.weight_decay": "L2 weight decay of local SGD",
  "algorithm.quantize_bits": (
    "bits per transmitted value (weights, NTK-FL's or NTK-DFL's Jacobian entries, or FedCOM's/QSGD's "
    "coordinates, sign included): 32 = float32"
  ),
  "algorithm.stochastic_rounding": "unbiased stochastic rounding when quantising",
  "algorithm.bucket_size": "FedCOM/QSGD: entries per QSGD bucket, each sent with its float32 norm (0 = one per tensor)",
  "algorithm.qsgd_norm": "FedCOM/QSGD: scale of a QSGD bucket: 'l2' (Alistarh et al.) or 'max' (largest magnitude)",
  "algorithm.server_lr": "FedCOM: server step γ on the averaged quantised update (1 = replace by the average)",
  "algorithm.clients_per_round": "participants per round (0 = all clients)",
  "algorithm.taus": "candidate evolution times τ; the best one is chosen each round",
  "algorithm.loss": "evolution loss: 'ce' (cross-entropy) or 'mse' (closed form)",
  "algorithm.solver": "cross-entropy evolution: 'euler' (exact function-space GD) or 'ode' (Dopri5)",
  "algorithm.select": "τ scored on the network w + Δw_τ ('network') or the linearised model ('linearized')",
  "algorithm.kernel": "'traced' [N, N] kernel (1/C) Σ_c J_c J_cᵀ, or the 'full' [N·C, N·C] kernel",
  "algorithm.subsample": "m2: each client uses a random ⌊n_i / m2⌋ of its samples per round (1 = all)",
  "algorithm.jacobian": "'auto' | 'implicit' (matrix-free) | 'explicit' (materialised Jacobian)",
  "algorithm.prox_mu": "FedProx proximal coefficient μ",
  # ------------------------------------------------------------------ algorithm: one method's own
  "algorithm.per_round_averaging": "NTK-DFL: average round-start weights over each neighbourhood (eq. 1)",
  "algorithm.jacobian_batches": "NTK-DFL: m1 blocks of the neighbourhood data (App. E.1)",
  "algorithm.jacobian_chunk": "NTK-FL: samples per explicit-Jacobian chunk (0 = automatic)",
  "algorithm.subsample_fraction": "NTK-FL, FedAvg: β, each participant's share of its samples per round",
  "algorithm.projection_dim": (
    "NTK-FL, NTK-DFL, FedAvg: d1' of the shared seeded input projection (0 = none; MLP only)"
  ),
  "algorithm.projection_scale": (
    "NTK-FL, NTK-DFL, FedAvg: scale of the input projection: 'sqrt_input' | 'none'"
  ),
  "algorithm.sparsify_keep": (
    "top-k fraction of the sent Jacobians kept (NTK-FL: per row; NTK-DFL: per package tensor; 1 = dense)"
  ),
  "algorithm.shuffle": "NTK-FL: the shuffling server (synchronised row permutation)",
  "algorithm.share_fraction": "DataShare: size of the shared global set relative to all local data",
  "algorithm.num_samples": "FedBE: M models sampled from the Gaussian over the client models",
  "algorithm.server_set_size": "FedBE: unlabelled server samples, drawn from those no client holds",
  "algorithm.distill_epochs": "FedBE: distillation passes over the server set (0 = FedAvg's mean)",
  "algorithm.distill_batch_size": "FedBE: distillation minibatch size",
  "algorithm.distill_lr": "FedBE: distillation SGD step size",
  "algorithm.distill_momentum": "FedBE: distillation SGD heavy-ball momentum",
  "algorithm.swa_start": "FedBE: SWA averages the distillation iterates after steps t > swa_start",
  "algorithm.swa_every": "FedBE: ... with t % swa_every == 0 (0 = no SWA, the last iterate)",
  "algorithm.posterior": (
    "FedBE: what the M models are sampled from: 'gaussian' (diagonal) | 'swag' (diagonal + low-rank)"
  ),
  "algorithm.sam_rho": "DFedSAM: SAM's perturbation radius ρ",
  "algorithm.sam_adaptive": "DFedSAM: adaptive SAM (ASAM)",
  "algorithm.dense_ratio": "DisPFL: density of each client's sparse mask",
  "algorithm.anneal_factor": "DisPFL: mask-update annealing factor",
  "algorithm.num_modes": "Fed-ensemble: K models (modes) trained in rotation",
  "algorithm.num_strata": "Fed-ensemble: Q client strata (0 = every client its own stratum)",
  "algorithm.sampling": "Fed-ensemble: client sampling 'uniform' | 'stratified'",
  "algorithm.aggregation_weights": "Fed-ensemble: 'uniform' | 'data_size' averaging of a mode's updates",
  "algorithm.local_training": "Fed-ensemble: local step 'fedavg' | 'fedprox' | 'ntk'",
  "algorithm.prediction": "Fed-ensemble: average the modes' 'probs' or 'logits'",
  "algorithm.velocity": "SPARK: momentum velocity kept 'local' (Alg. 1) or 'mixed' with the weights",
  "algorithm.select_momentum": "SPARK: score τ on the network after the momentum step",
  "algorithm.share_cliques": "SPARK: on the clustered topology evolve once per clique (exact)",
  "algorithm.projected_kernel": "SPARK: sketched kernel 'auto' | 'structured' | 'generic'",
  "algorithm.distill.enabled": "SPARK: annealed self-distillation targets (Alg. 2)",
  "algorithm.distill.warmup_rounds": "SPARK: rounds of hard labels before distillation starts",
  "algorithm.distill.anneal_rounds": "SPARK: annealing horizon R (0 = config.rounds)",
  "algorithm.distill.alpha_init": "SPARK: weight α of the hard labels when annealing starts",
  "algorithm.distill.alpha_final": "SPARK: weight α of the hard labels at the end of annealing",
  "algorithm.distill.temp_init": "SPARK: softmax temperature T when annealing starts",
  "algorithm.distill.temp_final": "SPARK: softmax temperature T at the end of annealing",
  "algorithm.projection.scheme": "SPARK: Jacobian random projection 'none' | 'layerwise' | 'flattened'",
  "algorithm.projection.k_proj": "SPARK: projected dimension (layer-wise: the cap per tensor)",
  "algorithm.projection.skip_uncompressed": "SPARK: leave a tensor unprojected when k_proj >= its dimension",
  "algorithm.compression.keep_fraction": "SPARK: top-k fraction of each sent Jacobian package (1 = dense)",
  "algorithm.compression.bits": "SPARK: quantisation of the kept Jacobian values (32 = float32)",
  "algorithm.lr_boost.rounds": "SPARK: 1-based rounds whose η is multiplied by lr_boost.factor",
  "algorithm.lr_boost.factor": "SPARK: learning-rate multiplier in lr_boost.rounds",
  # ------------------------------------------------------------ fed_ensemble_toy (its own script)
  "num_clients": "toy regression: clients",
  "points_per_client": "toy regression: data points per client",
  "num_features": "toy regression: fixed RBF features",
  "bandwidth": "toy regression: RBF bandwidth b",
  "noise_sd": "toy regression: label noise standard deviation",
  "amplitude_sd": "toy regression: standard deviation of the client amplitude ~ N(1, sd²)",
  "repetitions": "toy regression: independent repetitions averaged",
  "modes": "toy regression: the ensemble sizes K compared",
  "local_steps": "toy regression: full-batch gradient steps per round",
  "lr": "toy regression: learning rate of the local steps",
  "init_std": "toy regression: standard deviation of the initial weights",
  "grid": "toy regression: equispaced x in [-1, 1] the bias and variance are averaged over",
}
"""Dotted config path (without the leading ``config.``) -> its one-line meaning."""

COMMON_VARIANT_DOCS: dict[str, str] = {
  "paper": "the paper setting (the default)",
  "iid": "IID split over the clients",
  "static": "one graph for all rounds",
  "mnist": "MNIST instead of Fashion-MNIST",
  "contiguous": "client i holds samples [200 i, 200 i + 200) (the NTK-FL code's fallback)",
  "alpha<float>": "the authors' fixed-size Dirichlet generator with that α, e.g. alpha0.5",
  "authors_alpha<α>[_d<k>]": "the authors' shipped Fashion-MNIST partition (α ∈ 0.1..0.5, draw k, default 0)",
  "authors_iid[_d<k>]": "the authors' shipped IID partition (draw k, default 0)",
}
"""The variants of :data:`ntk_fl.config.COMMON_VARIANTS` and the parametrised ones."""


def flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
  """``(dotted path, value)`` of every leaf of a nested config mapping, in its order."""
  for key, value in config.items():
    if isinstance(value, Mapping):
      yield from flatten(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def field_doc(path: str) -> str | None:
  """The meaning of ``path`` (``'data.alpha'`` or ``'config.data.alpha'``); None if unknown."""
  return FIELD_DOCS.get(path[len("config.") :] if path.startswith("config.") else path)


def format_config(config) -> str:
  """Every field of ``config`` (a ``ConfigDict`` or mapping): ``config.path = value  # meaning``."""
  as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  rows = [
    (f"config.{path} = {value!r}", field_doc(path) or "(no description)")
    for path, value in flatten(as_dict)
  ]
  width = max(len(left) for left, _ in rows)
  return "\n".join(f"{left:<{width}}  # {doc}" for left, doc in rows)


def _config_module(name: str):
  from ntk_fl import configs  # pylint: disable=import-outside-toplevel

  path = configs.CONFIG_DIR / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"ntk_fl_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _method_variants(name: str):
  """``(module, variants)``: a packaged config's module and the method variants its ``get_config``
  passes to :func:`ntk_fl.config.apply_variants` (its ``VARIANTS`` or a preset's; or ``{}``)."""
  from ntk_fl import config as config_lib  # pylint: disable=import-outside-toplevel

  seen, seen_valued = {}, {}
  apply_variants = config_lib.apply_variants

  def recording(config, arg, method_variants=None, valued_variants=None):
    seen.update(method_variants or {})
    seen_valued.update(valued_variants or {})
    return apply_variants(config, arg, method_variants, valued_variants)

  # Config files bind it when executed, or call it through the module: both see the recorder.
  config_lib.apply_variants = recording
  try:
    module = _config_module(name)
    module.get_config(None)
  finally:
    config_lib.apply_variants = apply_variants
  module.VALUED_TOKENS = tuple(seen_valued)  # the prefixes of its ``<prefix><value>`` tokens
  return module, seen


def _docstring_variants(doc: str) -> dict[str, str]:
  """The ``Variants`` list of a config's docstring (``  name[ / name2]   description`` lines)."""
  found: dict[str, str] = {}
  lines = doc.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith("Variants")), None)
  if start is None:
    return found
  last = None
  for line in lines[start + 1 :]:
    if not line.strip():
      break
    match = re.match(r"^  (\S.*?)(?:\s{2,}(\S.*))?$", line)
    if match and not line.startswith("    "):
      last = [n.strip() for n in match.group(1).split("/")]
      for name in last:
        found[name] = (match.group(2) or "").strip()
    elif last:  # a continued description
      for name in last:
        found[name] = f"{found[name]} {line.strip()}".strip()
  return found


def _changes(default: Mapping, variant: Mapping, limit: int = 100) -> str:
  """``'sets a.b = 1, c = 2'``: the fields ``variant`` changes (cut to ``limit`` characters)."""
  before = dict(flatten(default))
  changed = [
    f"{path} = {value!r}" for path, value in flatten(variant) if before.get(path, object()) != value
  ]
  text = "sets " + ", ".join(changed) if changed else "changes no field"
  return text if len(text) <= limit else text[: limit - 3].rsplit(", ", 1)[0] + ", ..."


def config_variants(name: str) -> dict[str, str]:
  """A packaged config's own variants -> one line: the description in its docstring's variant list,
  or else the fields the variant sets."""
  module, variants = _method_variants(name)
  described = _docstring_variants(module.__doc__ or "")
  default = module.get_config(None).to_dict()
  return {
    variant: described.get(variant) or _changes(default, module.get_config(variant).to_dict())
    for variant in variants
  }


def valued_variants(name: str) -> dict[str, str]:
  """A packaged config's ``<prefix><value>`` tokens (e.g. ``topk<float>``) -> one line: the description
  in its docstring's variant list, or else the prefix with ``<value>``."""
  module, _ = _method_variants(name)
  described = _docstring_variants(module.__doc__ or "")
  found = {}
  for prefix in module.VALUED_TOKENS:
    key = next((k for k in described if k.startswith(prefix + "<")), f"{prefix}<value>")
    found[key] = described.get(key, "")
  return found


def format_configs() -> str:
  """The packaged configs, each with its own variants, then the variants every config knows."""
  from ntk_fl import configs  # pylint: disable=import-outside-toplevel

  out = ["Packaged configs (--config=NAME[:variant,variant...]):"]
  for name in configs.names():
    module = _config_module(name)
    title = (module.__doc__ or "").strip().splitlines()[0] if (module.__doc__ or "").strip() else ""
    out.append(f"\n{name}: {title}")
    for variant, doc in {**config_variants(name), **valued_variants(name)}.items():
      out.append(f"  {name + ':' + variant:<28} {doc}")
  out.append("\nVariants every config understands:")
  out.extend(f"  {variant:<28} {doc}" for variant, doc in COMMON_VARIANT_DOCS.items())
  return "\n".join(out)
