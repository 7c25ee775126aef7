"""What a round of an NTK method will cost, estimated before round 1 from a short calibration.

An NTK method's round is dominated by its client steps (:func:`ntk_fl.evolve.ntk_step`): ``S`` steps per
round, each on a kernel block of ``N`` samples. :func:`workload` reads ``S`` and ``N`` from the run
settings:

=====================  ======================================  =============================================
method                 steps per round ``S``                   samples per kernel block ``N``
=====================  ======================================  =============================================
``ntk_dfl``            ``M · m1`` (``m1`` Jacobian batches)     ``(k_max + 1) · ⌈⌈n_max / m2⌉ / m1⌉`` (†)
``spark``              ``M`` (cliques, when shared)            ``(k_max + 1) · ⌈n_max / m2⌉`` (†)
``ntk_fl, cp_ntk_fl``  ``1`` (the server)                      participants · ``⌈β · n_max⌉``
``fed_ensemble`` ntk   ``K`` (one per mode)                    participants / ``K`` · ``n_max``
=====================  ======================================  =============================================

(``M`` clients, ``n_max`` samples per client slot, ``k_max`` neighbour slots, ``m2`` sub-sampling.) The
other methods train by gradient steps and get no estimate. (†) Where the round gives each client its
degree group's slots (an Erdős–Rényi graph, clients mapped in chunks, an update that fits any slot count:
NTK-DFL uncompressed, SPARK uncompressed with Option A), ``k_max + 1`` becomes
the root mean square of ``1 +`` round 0's clients' group slots: the steps cost what blocks of that size
cost together.

Compressed Jacobians change the step, and the estimate follows. With compression (``sparsify_keep < 1``
or ``quantize_bits < 32``; NTK-FL's ``jacobian='explicit'`` too) the step materialises the Jacobians
``J [N, C, d]``: NTK-FL's server its pooled uploads (CP-NTK-FL's ``table1``), an NTK-DFL client its
neighbourhood's, its own rows exact and each neighbour's slot a compressed package (App. E.3,
:attr:`Workload.packages`). The calibrated step is then the method's ``transmitted_step``: it builds ``J``,
sparsifies and quantises it as the messages are, and contracts it, ``2·N²·C·d`` FLOPs traced instead of
the structured kernel's, and holds ``N·C·d`` floats several times over. With ``select='validation'`` every
candidate network of the ``τ`` grid is scored on the pooled data of the validation clients (``score_block
= validation_clients · n_max`` samples, ``T`` forward passes): the calibrated step scores a random block
of that size, and :attr:`Calibration.scoring_flops` is XLA's count of that scoring alone (for an MLP of
widths ``d_0, ..., d_L``: ``T · S · 2 Σ_l d_l d_{l+1}`` plus the loss's elementwise terms). With the input
projection (``projection_dim``), CP-NTK-FL's server and NTK-DFL's clients train the MLP on the
``d1'``-wide projected inputs: the calibrated network is that one.

:func:`calibrate` compiles one plain NTK step (the method's kernel, loss, solver and ``τ`` grid) on a
random block of ``N`` inputs, runs it twice and keeps the faster run (a kernel above
:data:`CALIBRATION_FLOPS` is run on a halved block, and halved again, and its time scaled by the
ratio of the kernels' FLOP counts, so the calibration stays short; the smaller block's kernel is computed by
the implementation the run's block takes, :func:`kernel_implementation`, since ``'auto'`` chooses by the
kernel's size; the explicit-Jacobian step, whose
top-k and quantisation are memory passes linear in ``N`` that XLA counts no FLOPs for, is timed on the
halved block and its half and extrapolated by ``a·N + b·N²`` instead); it also reads XLA's FLOP count of
the kernel alone on that block (``lowered.cost_analysis()``, the whole block in one piece so that no
loop hides its body's repetitions) and the step's memory (``compiled.memory_analysis()``: arguments,
outputs and temporaries). :func:`estimate` scales them: round time ``≈ S × step time``
(the clients of a round run one after another or in vmapped chunks, whose cost grows with their size);
peak memory ``≈`` clients per chunk ``×`` one step's memory ``+`` two copies of the clients' parameters
(the state a round starts from and the one it returns). SPARK's sketch and compression change the
step's constant factors; the estimate uses the plain step there, so read it as the
order of magnitude it is.

:func:`report` logs the estimate (INFO: the workdir's ``log.txt``) and warns (WARNING: the console too)
when a round is estimated above ``budget_s`` (10 minutes by default), saying what would help: a GPU
when the run is on the CPU, the structured kernel when the model has none, a smaller ``N``.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

__all__ = [
  "Workload",
  "Calibration",
  "Estimate",
  "workload",
  "kernel_flops",
  "kernel_implementation",
  "scoring_flops",
  "calibrate",
  "estimate",
  "advice",
  "describe",
  "over_budget",
  "report",
  "run_estimate",
  "ROUND_BUDGET_S",
  "CALIBRATION_FLOPS",
]

ROUND_BUDGET_S = 600.0
"""A round estimated above this many seconds is warned about."""

CALIBRATION_FLOPS = 2e10
"""Largest kernel (FLOPs) the calibration runs; a bigger block is timed smaller and scaled up."""


class Workload(NamedTuple):
  """``steps`` NTK client steps per round on kernel blocks of ``block`` samples; the step's options.

  ``explicit``: the step materialises the block's Jacobians ``[N, C, d]`` (compressed as
  ``keep_fraction`` and ``bits`` say) and contracts them (NTK-FL's server, NTK-DFL's clients with
  compression); ``packages``: the block is that many equal slots of rows, the first the step's own and
  exact, each other one sender's compressed package (NTK-DFL's neighbourhood; 0 = the pooled uploads of
  a server, compressed row by row);
  ``score_block``: samples every ``τ`` candidate is scored on besides the block (NTK-FL's validation
  clients; 0 = the block's own samples); ``input_dim``: the network's input width when the step trains
  an MLP on projected inputs (CP-NTK-FL's and NTK-DFL's ``projection_dim``; 0 = the model's own inputs).
  """

  steps: int
  block: int
  concurrent: int  # steps computed at once (vmapped chunk of clients)
  options: dict  # ntk_step keyword options: taus, loss, solver, kernel, select
  explicit: bool = False
  keep_fraction: float = 1.0
  bits: int = 32
  score_block: int = 0
  input_dim: int = 0
  packages: int = 0


class Calibration(NamedTuple):
  """One NTK step on a block of ``block`` samples, measured after compilation.

  A block whose kernel exceeds :data:`CALIBRATION_FLOPS` is not run whole: the step is timed on
  ``timed_block`` samples (halving ``block`` until the kernel fits) and ``seconds`` is that time
  scaled by the ratio of the two blocks' kernel FLOP counts (the kernel dominates such steps).
  """

  block: int
  seconds: float  # wall time of one compiled step on `block` samples (the faster of two runs)
  compile_seconds: float
  kernel_flops: float  # XLA's FLOP count of the kernel alone on the block
  step_bytes: int  # arguments + outputs + temporaries of the compiled step on `block` samples
  timed_block: int = 0  # the block actually run (= block unless extrapolated)
  scoring_flops: float = (
    0.0  # XLA's FLOP count of scoring the τ candidates on `score_block` samples
  )


class Estimate(NamedTuple):
  """A round's estimated cost on the current device."""

  workload: Workload
  calibration: Calibration
  kernel_flops: float  # per round: steps × kernel FLOPs per block
  peak_bytes: int
  round_seconds: float
  device: str
  scoring_flops: float = 0.0  # per round: steps × the candidates' scoring on the validation clients


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _members(graphs, *, grouped: bool) -> int:
  """Members of the block the round's steps are costed at: ``k_max + 1``, or, where the round gives each
  client its degree group's slots (``ntk_fl.topology.Topology.client_slots``), the root mean square over
  round 0's clients of ``1 +`` their group's slots (a step's cost grows with the square of its block)."""
  if not grouped or len(graphs.slot_groups) < 2:
    return graphs.k_max + 1
  members = 1 + graphs.client_slots(graphs.sample(0))
  return max(1, round(float(np.sqrt(np.mean(members**2)))))


def workload(settings, model, federation) -> Workload | None:
  """The NTK client steps of one round of ``settings.method`` (module docstring), or ``None``."""
  algo, method = settings.algorithm, settings.method
  num_clients, n_max = (int(d) for d in federation.mask.shape)
  chunk = settings.chunk_size or num_clients
  options = lambda kernel: dict(
    taus=tuple(algo.taus),
    loss=getattr(algo, "loss", "ce"),
    solver=algo.solver,
    kernel=kernel,
    # NTK-FL's 'validation' scores the network on held-out clients: a 'network' scoring, as timed.
    select="network" if algo.select == "validation" else algo.select,
  )
  if method in ("ntk_dfl", "spark"):
    graphs = settings.built_topology
    m1 = int(getattr(algo, "jacobian_batches", 1))
    per_member = _ceil_div(_ceil_div(n_max, int(algo.subsample)), m1)
    steps = num_clients
    if method == "spark" and algo.share_cliques and graphs.cliques:
      steps = graphs.cliques
    # The round groups clients by degree where the update fits any slot count (uncompressed, SPARK's
    # Option A) and clients are mapped in chunks of fewer than all.
    grouped = algo.any_slot_count and 1 <= chunk < steps
    members = _members(graphs, grouped=grouped)
    work = Workload(steps * m1, members * per_member, min(chunk, steps), options(algo.kernel))
    if method == "spark":  # its sketch and package compression: the plain step (module docstring)
      return work
    # NTK-DFL's client trains the MLP on the projected inputs, and with compressed packages holds its
    # neighbourhood's Jacobian explicitly (algorithms.ntk_dfl.transmitted_step).
    compressed = bool(algo.compressed)
    return work._replace(
      explicit=compressed,
      keep_fraction=float(algo.sparsify_keep),
      bits=int(algo.quantize_bits),
      input_dim=int(algo.projection_dim),
      packages=members if compressed else 0,
    )
  if method in ("ntk_fl", "cp_ntk_fl"):
    participants = algo.clients_per_round or num_clients
    keep, bits = float(algo.sparsify_keep), int(algo.quantize_bits)
    # As the server decides (algorithms.server_ntk.uses_explicit_jacobian): compression alters J.
    explicit = algo.jacobian == "explicit" or (algo.jacobian == "auto" and (keep < 1 or bits != 32))
    return Workload(
      1,
      participants * math.ceil(algo.subsample_fraction * n_max),
      1,
      options(algo.kernel),
      explicit=explicit,
      keep_fraction=keep,
      bits=bits,
      score_block=int(getattr(algo, "validation_clients", 0)) * n_max,
      input_dim=int(algo.projection_dim),
    )
  if method == "fed_ensemble" and algo.local_training == "ntk":
    participants = algo.clients_per_round or num_clients
    block = max(participants // algo.num_modes, 1) * n_max
    return Workload(algo.num_modes, block, 1, options("traced"))
  return None


def _random_block(model, block: int, seed: int):
  """Gaussian inputs ``[block, *input_shape]`` and one-hot random labels ``[block, C]`` (float32) from
  ``seed``. Drawn with numpy: eager ``jax.random`` draws compile a program per block size, and the explicit
  path's calibration times three sizes."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((block, *model.input_shape), dtype=np.float32)
  y = np.eye(model.num_classes, dtype=np.float32)[rng.integers(0, model.num_classes, size=block)]
  return jnp.asarray(x), jnp.asarray(y)


def kernel_implementation(
  model, block: int, kernel: str = "traced", *, ntk, explicit: bool = False
) -> str:
  """The implementation the model's NTK on ``block`` samples takes under ``'auto'``, as the run computes it
  (``ntk.auto_implementation``: ``'structured'``, ``'jacobian'`` or ``'ntvp'``); ``'auto'`` where no choice
  depends on the block: explicit Jacobians, a model that is not per-sample (its whole batch is one
  sample), ``NtkFunctions`` without ``auto_implementation``.

  ``'auto'`` picks ``'ntvp'`` for the traced kernel of a net that does not reuse its weights only up to
  ``256²`` sample pairs (:func:`ntk_fl._src.kernels.generic_choice`): a block timed smaller than the run's
  must be computed by the run's block's choice, or the estimate scales another implementation's time.
  """
  if explicit or not getattr(model, "per_sample", True) or ntk.auto_implementation is None:
    return "auto"
  params = jax.eval_shape(model.init, jax.random.key(0))
  x = jax.ShapeDtypeStruct((block, *model.input_shape), jnp.float32)
  impl = ntk.auto_implementation(
    model.apply,
    params,
    x,
    trace_outputs=kernel == "traced",
    dense_stack=model.dense_stack,
    flax_apply=getattr(model, "flax_apply", None),
  )
  return impl.short_name


def kernel_flops(
  model,
  block: int,
  kernel: str = "traced",
  *,
  ntk,
  explicit: bool = False,
  implementation: str = "auto",
) -> float:
  """XLA's FLOP count of the model's NTK on ``block`` random inputs (lowered, neither compiled nor run).

  The kernel is ``ntk.empirical_ntk`` (:func:`ntk_fl.ntk.empirical_ntk`) with ``implementation`` (default
  the library's choice for the model and ``block``: the dense-stack or the layer-wise structured one where
  they apply), the block in one piece; ``explicit``: the flat Jacobians ``[N, C, d]`` built and contracted
  (``ntk.flat_jacobian``, ``ntk.jacobian_kernel``), as NTK-FL's server does with compression. ``ntk``:
  the method's ``NtkFunctions`` (``ntk_fl._src.ntk_step.NTK_FUNCTIONS``).
  """
  params = jax.eval_shape(model.init, jax.random.key(0))
  x = jax.ShapeDtypeStruct((block, *model.input_shape), jnp.float32)
  traced = kernel == "traced"
  if explicit:
    kernel_fn = lambda p, x: ntk.jacobian_kernel(
      ntk.flat_jacobian(model.apply, p, x), trace_outputs=traced
    )
  elif getattr(model, "per_sample", True):
    kernel_fn = lambda p, x: ntk.empirical_ntk(
      model.apply,
      p,
      x,
      trace_outputs=traced,
      implementation=implementation,
      dense_stack=model.dense_stack,
      flax_apply=getattr(model, "flax_apply", None),
      chunk_size=block,
    )
  else:  # the whole batch's Jacobian (neural-tangents' vmap_axes=None), as the NTK step takes it
    kernel_fn = lambda p, x: ntk.empirical_ntk_fn(
      model.apply, trace_axes=(-1,) if traced else (), vmap_axes=None
    )(x, None, p)
  fn = jax.jit(kernel_fn)
  # The lowered program's count: compiling the kernel only to count its FLOPs cost the CNN's estimate as
  # long as compiling the step it calibrates (10-13 s on a loaded 2-core CPU); the compiled count differs
  # by the optimiser's rewrites, within 3 % (the CNN at N = 27: 4.56 vs 4.67 GFLOP; the MLP: 0.01 %).
  return xla_flops(fn.lower(params, x))


def _score_fn(model, vx, vy, vm, ntk):
  return lambda w: ntk.mean_loss(model.apply(w, vx), vy, vm, "ce")


def scoring_flops(model, score_block: int, num_taus: int, *, ntk) -> float:
  """XLA's FLOP count of scoring ``num_taus`` candidate networks on ``score_block`` samples (compiled, not
  run): the mean cross-entropy of each candidate's logits, as NTK-FL's validation clients score ``τ``."""
  if not score_block:
    return 0.0
  params = jax.eval_shape(model.init, jax.random.key(0))
  stacked = jax.tree.map(lambda p: jax.ShapeDtypeStruct((num_taus, *p.shape), p.dtype), params)
  vx = jax.ShapeDtypeStruct((score_block, *model.input_shape), jnp.float32)
  vy = jax.ShapeDtypeStruct((score_block, model.num_classes), jnp.float32)
  vm = jax.ShapeDtypeStruct((score_block,), jnp.bool_)
  fn = jax.jit(lambda w, x, y, m: jax.vmap(_score_fn(model, x, y, m, ntk))(w))
  return xla_flops(fn.lower(stacked, vx, vy, vm).compile())


def xla_flops(program) -> float:
  """XLA's FLOP count of a lowered or compiled program (``nan`` where the backend reports none)."""
  analysis = program.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
    analysis = analysis[0] if analysis else {}
  return float((analysis or {}).get("flops", float("nan")))


def _bytes(compiled) -> int:
  memory = compiled.memory_analysis()
  if memory is None:
    return 0
  return int(
    sum(
      getattr(memory, f, 0) or 0
      for f in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    )
  )


def _trained_model(model, work: Workload, ntk):
  """The network the step trains: the model, or (``input_dim``) the same MLP on projected inputs
  (``ntk.projected_model``, the method's)."""
  if not work.input_dim:
    return model
  if ntk.projected_model is None:
    raise ValueError(
      f"the workload trains on {work.input_dim}-dimensional projected inputs, but the method's "
      "NtkFunctions have no projected_model to build that network"
    )
  return ntk.projected_model(model, work.input_dim)


def _step_fn(model, work: Workload, ntk, implementation: str = "auto"):
  """``step(params, x, y, mask, vx, vy, vm) -> Δw``: one NTK step of ``work``'s options (module docstring):
  ``ntk.step`` with the kernel's ``implementation``, or on the explicit path ``ntk.transmitted_step`` (the
  method's)."""
  model_options = dict(
    kernel_impl=implementation,
    dense_stack=model.dense_stack,
    flax_apply=getattr(model, "flax_apply", None),
    per_sample=getattr(model, "per_sample", True),
  )
  if work.explicit and ntk.transmitted_step is None:
    raise ValueError(
      "the workload computes explicit (transmitted) Jacobians, but the method's NtkFunctions have no "
      "transmitted_step"
    )

  def step(p, x, y, m, vx, vy, vm):
    extra = {"score_fn": _score_fn(model, vx, vy, vm, ntk)} if work.score_block else {}
    if not work.explicit:
      return ntk.step(model.apply, p, x, y, m, lr=0.01, **model_options, **work.options, **extra)[0]
    per_slot = dict(slots=work.packages, dense_stack=model.dense_stack) if work.packages else {}
    return ntk.transmitted_step(
      model.apply,
      p,
      x,
      y,
      m,
      lr=0.01,
      keep_fraction=work.keep_fraction,
      bits=work.bits,
      **per_slot,
      **work.options,
      **extra,
    )[0]

  return jax.jit(step)


def _halved(n: int, unit: int) -> int:
  """About half of ``n``, in whole ``unit``s, at least one."""
  return max(unit, n // 2 // unit * unit)


def _extrapolate(small: tuple[int, float], large: tuple[int, float], n: int) -> float:
  """``a·n + b·n²`` through two timed points ``(N, seconds)``, ``a, b >= 0`` (a noisy pair whose line would
  give a negative coefficient keeps only the other term, fitted to the larger point)."""
  (n1, t1), (n2, t2) = small, large
  b = (t2 / n2 - t1 / n1) / (n2 - n1)
  a = t2 / n2 - b * n2
  if b < 0:
    a, b = t2 / n2, 0.0
  elif a < 0:
    a, b = 0.0, t2 / n2**2
  return a * n + b * n * n


def calibrate(
  model, work: Workload, *, ntk, seed: int = 0, max_flops: float = CALIBRATION_FLOPS
) -> Calibration:
  """Compiles and times one NTK step of ``work``'s options on a random block (module docstring);
  ``ntk``: the method's ``NtkFunctions``, whose step and kernels are compiled.

  A kernel above ``max_flops`` is timed on a smaller block and scaled (:class:`Calibration`); the
  validation block (``work.score_block``) keeps its size.
  """
  model = _trained_model(model, work, ntk)
  params = model.init(jax.random.key(seed))
  kernel = work.options["kernel"]
  # The run's block's implementation, for the smaller timed block too ('auto' chooses by the kernel's size).
  impl = kernel_implementation(model, work.block, kernel, ntk=ntk, explicit=work.explicit)
  step = _step_fn(model, work, ntk, impl)
  score = _random_block(model, work.score_block, seed + 2)
  score = (*score, jnp.ones((work.score_block,), bool))

  def compiled_step(block):
    x, y = _random_block(model, block, seed + 1)
    args = (params, x, y, jnp.ones((block,), bool), *score)
    return step.lower(*args).compile(), args

  flops = kernel_flops(
    model, work.block, kernel, ntk=ntk, explicit=work.explicit, implementation=impl
  )
  # A block of packages is timed in whole slots (every slot keeps its share of the rows).
  unit = work.packages or 1
  timed = work.block
  while (
    timed > max(8, unit) and flops * (timed / work.block) ** 2 > max_flops
  ):  # the kernel grows at least ~N²
    timed = _halved(timed, unit)
  t0 = time.perf_counter()
  compiled, args = compiled_step(work.block)
  compile_seconds = time.perf_counter() - t0
  step_bytes = _bytes(compiled)

  def best_of_two(compiled, args):
    times = []
    for _ in range(2):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - t0)
    return min(times)

  if timed == work.block:
    seconds = best_of_two(compiled, args)
  elif not work.explicit:  # the kernel dominates: scale by the kernels' FLOP ratio
    seconds = best_of_two(*compiled_step(timed)) * (
      flops / kernel_flops(model, timed, kernel, ntk=ntk, implementation=impl)
    )
  else:
    # The explicit path's top-k and quantisation of J are O(N·C·d) memory passes that XLA counts no FLOPs
    # for: fit t(N) = a·N + b·N² through two timed blocks instead.
    half = _halved(timed, unit)
    large = (timed, best_of_two(*compiled_step(timed)))
    if half < timed:
      seconds = _extrapolate((half, best_of_two(*compiled_step(half))), large, work.block)
    else:  # one row a slot: no smaller block of whole slots; the kernel's N² bounds the rest
      seconds = large[1] * (work.block / timed) ** 2
  return Calibration(
    work.block,
    seconds,
    compile_seconds,
    flops,
    step_bytes,
    timed,
    scoring_flops(model, work.score_block, len(work.options["taus"]), ntk=ntk),
  )


def estimate(
  settings, model, federation, *, ntk=None, calibration: Calibration | None = None
) -> Estimate | None:
  """The round cost of the run ``settings`` on ``model`` and ``federation`` (``None``: no NTK step).

  ``ntk``: the method's ``NtkFunctions`` (:attr:`ntk_fl.algorithms.Method.ntk`), compiled by the
  calibration; without them (and without a ``calibration``) there is no estimate. With a given
  ``calibration`` and no ``ntk``, the parameter memory is the model's own (not a projected-input MLP's).
  """
  work = workload(settings, model, federation)
  if work is None or (calibration is None and ntk is None):
    return None
  cal = calibrate(model, work, ntk=ntk, seed=settings.seed) if calibration is None else calibration
  num_clients = int(federation.mask.shape[0])
  trained = model if ntk is None else _trained_model(model, work, ntk)
  param_bytes = 4 * sum(
    math.prod(leaf.shape)
    for leaf in jax.tree.leaves(jax.eval_shape(trained.init, jax.random.key(0)))
  )
  peak = work.concurrent * cal.step_bytes + 2 * num_clients * param_bytes
  device = jax.devices()[0]
  name = (
    device.platform if device.platform == "cpu" else f"{device.platform} ({device.device_kind})"
  )
  return Estimate(
    work,
    cal,
    work.steps * cal.kernel_flops,
    int(peak),
    work.steps * cal.seconds,
    name,
    work.steps * cal.scoring_flops,
  )


def advice(est: Estimate, model, *, platform: str | None = None) -> list[str]:
  """What would make a round cheaper, most effective first."""
  platform = platform or jax.default_backend()
  tips = []
  if platform == "cpu":
    tips.append(
      "a GPU (run on a machine with one: the kernels and the evolution are matrix products)"
    )
  if not getattr(model, "per_sample", True):
    tips.append(
      "the structured kernel: declare the model per-sample (config.model.per_sample=True) if "
      "its outputs do not depend on the rest of the batch"
    )
  elif model.dense_stack is None and getattr(model, "flax_apply", None) is None:
    tips.append("the structured kernel (a flax module, whose layers the library factorises)")
  tips.append(
    f"a smaller kernel block N = {est.workload.block} (fewer samples per client, a smaller "
    "topology degree, Jacobian batches or sub-sampling): the kernel costs O(N²), the evolution "
    "O(τ_max · N²)"
  )
  return tips


def _human(x: float, unit: str) -> str:
  for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}"


def describe(est: Estimate) -> str:
  """One line: the steps and their block, the kernel FLOPs, the calibrated step, peak memory, the round."""
  w, c = est.workload, est.calibration
  timed = ""
  if c.timed_block and c.timed_block != c.block:
    timed = (
      f" (timed on N = {c.timed_block} and a smaller block, extrapolated as a·N + b·N²)"
      if w.explicit
      else f" (timed on N = {c.timed_block} and scaled by the kernels' FLOP ratio)"
    )
  kernel_kind = " (explicit Jacobians [N, C, d] contracted)" if w.explicit else ""
  scoring = (
    f"; scoring the {len(w.options['taus'])} τ candidates on {w.score_block} validation samples "
    f"{_human(est.scoring_flops, 'FLOP')} per round"
    if w.score_block
    else ""
  )
  return (
    f"cost estimate on {est.device}: {w.steps} NTK step(s) per round on kernel blocks of N = "
    f"{w.block} samples; kernel{kernel_kind} {_human(est.kernel_flops, 'FLOP')} per round "
    f"({_human(c.kernel_flops, 'FLOP')} per block){scoring}; one step {c.seconds:.3g} s{timed} after a "
    f"{c.compile_seconds:.3g} s compile; peak memory ~ {_human(est.peak_bytes, 'B')}; a round ~ "
    f"{est.round_seconds:.3g} s"
  )


def over_budget(est: Estimate, model, *, budget_s: float = ROUND_BUDGET_S) -> str | None:
  """The warning for a round estimated above ``budget_s``, with what would help; ``None`` within it."""
  if not est.round_seconds > budget_s:
    return None
  w, c = est.workload, est.calibration
  return (
    f"a round is estimated at {est.round_seconds / 60:.1f} min on {est.device} ({w.steps} NTK steps "
    f"x {c.seconds:.3g} s, kernel {_human(est.kernel_flops, 'FLOP')} per round); what would help: "
    + "; ".join(advice(est, model))
  )


def report(est: Estimate | None, model, *, budget_s: float = ROUND_BUDGET_S) -> str | None:
  """Logs ``est`` (INFO, :func:`describe`) and warns (WARNING) when a round exceeds ``budget_s``; returns
  the warning."""
  if est is None:
    return None
  logging.info("%s", describe(est))
  message = over_budget(est, model, budget_s=budget_s)
  if message:
    logging.warning("%s", message)
  return message


def run_estimate(
  settings, model, federation, *, ntk=None, budget_s: float = ROUND_BUDGET_S
) -> Estimate | None:
  """:func:`estimate` then :func:`report`: the runner's one call before round 1 (``ntk``: the method's)."""
  est = estimate(settings, model, federation, ntk=ntk)
  report(est, model, budget_s=budget_s)
  return est
