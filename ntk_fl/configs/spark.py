"""SPARK (Xia, arXiv 2512.12737v2) -- the paper setting, its ablations and compression variants.

Default (``--config=configs/spark.py``): NTK-DFL's setting (configs/ntk_dfl.py:
Fashion-MNIST, 300 clients, authors' Dirichlet partition α = 0.1, MLP 784-100-10,
new random 5-regular graph every round, data-size-weighted averaging, τ ∈ {100,
..., 800}, η = 0.01 constant, CE evolution by exact function-space GD) plus:

* Nesterov momentum μ = 0.9 on the per-round NTK update (paper A.1), optax
  ``sgd(1, 0.9, nesterov=True)`` on ``−Δw``; the velocity stays local.
* Annealed distillation targets (Alg. 2). The paper gives no values
  (spark.md §5 items 1-3); chosen here: R = 30 rounds (= ``rounds``; the paper
  reports round-30 accuracy), warm-up R_warm = 10 (middle of the tested
  5/10/15), α cosine-annealed from 1.0 (no jump at the end of warm-up) to 0.6
  (in the suggested 0.5-0.7), and the temperature held at 1 (T_init = T_final =
  1, the lower end of the allowed T_final >= T_init >= 1). Chosen by measurement
  (docs/spark.md, "Small federation"; 30 clients, α = 0.1, 12 rounds, warm-up 4).
  With the teacher = the student's own start f(X; w̄_i) (Option A below), T > 1
  makes the soft part flatter than the student's prediction, a confidence
  penalty. Momentum accumulates that direction (it is the same for every client
  and round), and the run collapsed: T_final = 3 fell 82.8% -> 59.0% in rounds
  9-12. At T = 1 distillation only damps the step by α: 83.1% peak, 82.5% at
  round 12, vs 82.2% momentum only and 81.2% NTK-DFL. Momentum alone did not
  collapse, and distillation alone with T_final = 3 lowered the teacher's
  confidence 0.82 -> 0.64. A milder α_final = 0.8, T_final = 2 still declined
  late (82.7% -> 81.7% in rounds 10-12).
* Soft labels from the consensus model ``w̄_i`` on the neighbourhood data, which
  are also the evolution's starting values (NTK-DFL's protocol: neighbours
  compute at the receiver's weights; spark.md §5 items 4-5, Option A).
* τ selection by the *hard-label* cross-entropy of the network ``w̄ + Δw_τ``
  (paper: ground-truth labels; NTK-DFL code: the real network).
* Kernel: the output-traced ``(1/C) Σ_c J_c J_cᵀ`` (docs/CONVENTIONS.md, convention 1: the
  kernel NTK-DFL was tuned with, so the ablation's "no momentum, no
  distillation" row *is* NTK-DFL); ``full_kernel`` is the paper's literal
  ``(N·C)²`` kernel (same ``η/N`` normalisation as the update, spark.md §5 item 8).
* No projection, no compression (the paper's main experiments). With a
  layer-wise projection the kernel is the structured dense-stack kernel in
  sketch coordinates (``projected_kernel='auto'``, ntk.projected_dense_ntk);
  with the flattened sketch or the compression stack, ``J̃`` is built from the
  dense stack's Jacobian factors (projection.sketched_dense_jacobian). On the
  clustered topology (``full_stack``) each clique evolves once
  (``share_cliques``; exact up to float order).
* Options not in the paper, off by default: ``velocity='mixed'`` (average the
  velocity with the weights), ``select_momentum=True`` (score τ on the network
  after the momentum step).

Variants (comma-separated, e.g. ``:iid,abl_momentum``):
  paper / iid / alpha<float> / static / mnist / cnn   as every method (ntk_fl.config.COMMON_VARIANTS;
                cnn: the papers' CNN; the layer-wise and flattened sketches need the MLP).
  authors_alpha<float>[_d<k>] / authors_iid[_d<k>]   the authors' partition files (draw 0 unless _d<k>).
  abl_none      Table 4 row 1: no distillation, no momentum (= NTK-DFL).
  abl_distill   Table 4 row 2: distillation only (Variant A).
  abl_momentum  Table 4 row 3: momentum only (Variant B).
  abl_both      Table 4 row 4: SPARK (the default; explicit for scripts).
  proj500 / proj750 / proj1000   layer-wise Jacobian projection with that cap (Fig. 9).
  flat10000     flattened projection, k_proj = 10,000 (App. A.2).
  full_stack    Fig. 11/12: flattened k_proj = 10,000, sparsification 0.5, 6-bit quantisation,
                sub-sampling m = 5, clustered topology (cliques of 6).
  cyclic_lr     the cyclic learning-rate boost (paper A.1 gives no details; chosen: η × 2 in rounds
                10 and 20, i.e. at the end of warm-up and mid-annealing). Off by default.
  full_kernel   the full (N·C)×(N·C) kernel instead of the traced one.
  temp3         the previous default temperature schedule 1 -> 3 (collapses late with momentum).
  option_b      Alg. 1 Option B: each client's Jacobian and logits at its own w̄_j, broadcast
                (``linearise_at='sender'``).
  ode           adaptive Dopri5 evolution (NTK-DFL authors' numerics).
  smoke         seconds-long run on a slice of Fashion-MNIST (CI): 4 rounds, warm-up 1, τ ∈ {50, 100, 200}.
"""

import ml_collections

from ntk_fl.config import apply_variants, base_config, smoke_slice


def _smoke(config):
  smoke_slice(config, rounds=4)
  config.algorithm.taus = (50, 100, 200)
  config.algorithm.distill.warmup_rounds = 1
  config.checkpoint_every = 2


def _set(**fields):
  def apply(config):
    for path, value in fields.items():
      block = config.algorithm
      *parents, leaf = path.split("__")
      for parent in parents:
        block = block[parent]
      block[leaf] = value

  return apply


def _projection(scheme, k_proj):
  return _set(projection__scheme=scheme, projection__k_proj=k_proj)


def _full_stack(config):
  _projection("flattened", 10_000)(config)
  config.algorithm.compression.keep_fraction = 0.5
  config.algorithm.compression.bits = 6
  config.algorithm.subsample = 5
  config.topology.name = "clustered"


VARIANTS = {
  "abl_none": _set(momentum=0.0, distill__enabled=False),
  "abl_distill": _set(momentum=0.0, distill__enabled=True),
  "abl_momentum": _set(momentum=0.9, distill__enabled=False),
  "abl_both": _set(momentum=0.9, distill__enabled=True),
  "proj500": _projection("layerwise", 500),
  "proj750": _projection("layerwise", 750),
  "proj1000": _projection("layerwise", 1000),
  "flat10000": _projection("flattened", 10_000),
  "full_stack": _full_stack,
  "cyclic_lr": _set(lr_boost__rounds=(10, 20), lr_boost__factor=2.0),
  "full_kernel": _set(kernel="full"),
  "temp3": _set(distill__temp_final=3.0),
  "ode": _set(solver="ode"),
  "option_b": _set(linearise_at="sender"),
  "smoke": _smoke,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = base_config()
  config.method = "spark"
  config.rounds = 30
  config.topology.mixing = "data_size"
  config.chunk_size = 1  # as NTK-DFL: one client's [N, N] kernel at a time stays cache-resident
  # Also score each client's consensus model w̄_i (one averaging step after its own model): Table 4's "client
  # accuracy" is most likely that model (docs/REPRODUCTION.md, "Client accuracy"); +1 client evaluation per round.
  config.eval.consensus = True

  a = config.algorithm = ml_collections.ConfigDict()
  a.lr = 0.01
  a.lr_decay = 0.0
  a.taus = (100, 200, 300, 400, 500, 600, 700, 800)
  a.solver = "euler"
  a.select = "network"
  a.kernel = "traced"
  a.subsample = 1
  a.momentum = 0.9
  a.nesterov = True
  # Options around spark.md §5 items 10 and 13 (off = the paper's Alg. 1; not needed by the measurements so far):
  a.velocity = "local"  # 'local' (Alg. 1) | 'mixed': averaged with the weights each round
  a.select_momentum = False  # τ* scored on w̄ + Δw_τ (False) or on the post-momentum network
  # On the clustered topology every member of a clique holds the same w̄ and data: evolve once per clique and give
  # each member the update (exact up to float summation order; cluster_size times less work). Other topologies
  # have no shared neighbourhoods and always evolve per client.
  a.share_cliques = True
  # 'auto': matrix-free (kernel of the lifted network, VJPs) unless the compression stack needs the explicit
  # sketched Jacobian; 'explicit' / 'implicit' force one path (they agree without compression).
  a.jacobian = "auto"
  # The sketched kernel: 'auto' = the structured dense-stack kernel in sketch coordinates (layer-wise sketch of
  # the MLP) and the generic per-sample-Jacobian kernel of the lifted network otherwise; 'generic' forces the
  # latter (a cross-check; ~350x slower per round for the MLP); 'structured' fails when it does not apply.
  a.projected_kernel = "auto"
  # Where a neighbour's Jacobian and logits are taken (spark.md §5 item 4): 'receiver' = at the receiver's w̄_i
  # (Option A, NTK-DFL's protocol); 'sender' = each client at its own w̄_j, one package broadcast to all
  # neighbours (Option B, Alg. 1 lines 5-8 literally; explicit Jacobians). Variant `option_b`.
  a.linearise_at = "receiver"

  a.distill = ml_collections.ConfigDict()
  a.distill.enabled = True
  a.distill.warmup_rounds = 10
  a.distill.anneal_rounds = 0  # R; 0 = config.rounds
  a.distill.alpha_init = 1.0
  a.distill.alpha_final = 0.6
  a.distill.temp_init = 1.0
  a.distill.temp_final = 1.0  # T > 1 flattens the self-teacher; momentum amplifies it (docstring)

  a.projection = ml_collections.ConfigDict()
  a.projection.scheme = "none"  # 'none' | 'layerwise' | 'flattened'
  a.projection.k_proj = 500
  a.projection.skip_uncompressed = True  # a cap >= a tensor's dimension leaves it unprojected

  a.compression = ml_collections.ConfigDict()
  a.compression.keep_fraction = 1.0  # top-k sparsification of each Jacobian package (1 = dense)
  a.compression.bits = 32  # quantisation of the kept values (32 = float32)

  a.lr_boost = ml_collections.ConfigDict()
  a.lr_boost.rounds = ()  # 1-based rounds whose η is multiplied by `factor`
  a.lr_boost.factor = 1.0
  return apply_variants(config, arg, VARIANTS)
