"""Shared experiment-config schema (ml_collections) used by every ``configs/<method>.py``.

A config file's ``get_config(arg)`` starts from :func:`base_config` and fills in
``config.method`` and the method's own ``config.algorithm`` block; ``arg`` picks
a named variant (``smoke``, ``paper``, ``iid``, ``alpha0.5``, ...).

Field reference (all of them are checked once, by :func:`ntk_fl.schema.validate_config`, before any work;
below it they travel as the frozen dataclasses of :mod:`ntk_fl.settings`):

* ``method``: registry name of the algorithm (``ntk_dfl``, ``dfedavg``, ...).
* ``method_module``: optional module (dotted name or ``.py`` path) imported before
  ``method`` is resolved, so a user's own registered method runs through
  ``experiments/main.py`` too.
* ``seed``: every random draw of a run derives from it.
* ``rounds``: communication rounds.
* ``data``: ``name`` (see :func:`ntk_fl.data.load`), ``data_dir`` (``''`` = search
  path), ``partition`` (``iid`` | ``dirichlet`` | ``dirichlet_fixed_size`` |
  ``shards`` | ``by_writer`` | ``contiguous`` | ``index_map``), ``partition_file``
  (``index_map`` only, and then required: a CSR ``.npz`` index map or the name of
  a shipped one, see :mod:`ntk_fl.data.index_map`), ``num_clients``, ``alpha``,
  ``samples_per_client``, ``classes_per_client``, ``keep_per_client`` (``shards``: a
  random subset of each client's samples, ``0`` = all), ``max_train`` / ``max_test``
  (``0`` = all; otherwise a random subset of that size drawn from the seed, for
  quick variants; an index map needs ``max_train = 0``, its indices refer to the
  whole training set).
* ``model``: ``name`` (``mlp`` | ``cnn``), ``hidden`` (MLP widths),
  ``activation``, ``init`` (``shared`` | ``per_client``), ``module`` (``''``, or the
  user's own flax module as ``'package.module:factory'``, called as
  ``factory(input_shape, num_classes)``; it replaces ``name``/``hidden``/``activation``
  and is trusted code, imported: see ``ntk_fl/_src/user_model.py``), ``per_sample``
  (``module`` only: the user states that the module's outputs for a sample do not
  depend on the rest of the batch, which lets the kernels map over samples; the
  library's own models are per-sample).
* ``topology``: ``name`` (``regular`` | ``erdos_renyi`` | ``ring`` | ``line`` |
  ``complete`` | ``clustered``), ``degree``, ``p`` / ``mean_degree`` (Erdős–Rényi),
  ``cluster_size``, ``dynamic`` (re-draw every round), ``k_max`` (static neighbour
  slots, ``0`` = derive from the topology), ``mixing`` (``uniform`` |
  ``data_size`` | ``metropolis``).
* ``eval``: ``every`` (rounds between aggregated-model evaluations),
  ``clients_every`` (rounds between per-client evaluations), ``targets``
  (accuracies for "rounds to X"), ``selection`` (final best-to-worst curves),
  ``batch_size`` (test-set batch for evaluation), ``stop_at`` (stop the run
  after the first round whose aggregated accuracy reaches it; ``0`` = run all
  ``rounds``; needs ``every = 1``), ``consensus`` (decentralized methods: whenever
  the clients are scored, also score their consensus models ``w̄_i``, the
  neighbourhood averages the next round starts from; ``consensus_acc_*``).
* ``checkpoint_every``: rounds between orbax checkpoints (``0`` = never); the
  two most recent are kept.
* ``checkpoint_keep``: 1-based rounds whose checkpoints are also written and
  never deleted (branch points, e.g. the end of SPARK's warm-up for its
  ablation rows; see ``rundir.check_branch``). Results do not depend on it.
* ``on_divergence``: what a round whose client models, training loss or test
  loss are not finite (NaN/inf) does: ``stop`` (default: the run ends at that
  round with a message, a non-zero exit status, ``summary.json`` status
  ``diverged``; the last good checkpoint is kept) or ``continue`` (for studies
  of divergence: logged, recorded in the summary, the run goes on).
* ``chunk_size``: clients per ``vmap`` chunk (``0`` = all at once), per device; with ``devices`` it is
  the run's device policy (:func:`ntk_fl.parallel.use_devices`).
* ``devices``: devices the client axis is sharded over (:mod:`ntk_fl.parallel`):
  ``0`` = all (every host's after ``--distributed``), ``1`` = the single-device
  path, ``n`` = the first ``n``. Results agree across device counts up to float
  rounding.
* ``replicas``: ``S >= 1`` seeds ``seed .. seed+S-1`` run as one compiled program (a seed-batched run):
  ``WORKDIR/seed<k>/`` is each seed's run directory, equal to its own single-seed run
  (:func:`ntk_fl.runner.run`). Results do not depend on it.
* ``replica_chunk``: replicas of a seed-batched run stepped at once by ``vmap`` (``1``, the default:
  one after another inside the compiled program, bit-identical to single-seed runs; ``0`` = all at
  once, for accelerator throughput, equal up to float rounding). Results agree up to float rounding.
* ``debug_clients``: the client map's debug mode (:func:`ntk_fl.parallel.use_devices` with
  ``debug=True``): nothing compiled, clients one at a time in a Python loop, and an exception
  names the client and the stage. Slow; for finding which client fails where.
* ``cost_estimate``: an NTK method's cost estimate before round 1 (:mod:`ntk_fl._src.cost`: one client
  step compiled and timed, logged to ``log.txt``); ``False`` skips it, and its compilation, where only
  the run's own time counts (a campaign on a shared device). Results do not depend on it.
* ``algorithm``: the method's own hyperparameters.
"""

from __future__ import annotations

import ml_collections

__all__ = [
  "base_config",
  "apply_variants",
  "COMMON_VARIANTS",
  "load_config",
  "smoke_slice",
  "SMOKE_CNN_SAMPLES",
  "SMOKE_CNN_CLIENTS",
  "SMOKE_CNN_TEST",
]


def base_config() -> ml_collections.ConfigDict:
  """The paper setting shared by the NTK papers: Fashion-MNIST, 300 clients, MLP 784-100-10."""
  config = ml_collections.ConfigDict()
  config.method = ""
  config.method_module = ""
  config.seed = 0
  config.rounds = 30

  config.data = ml_collections.ConfigDict()
  config.data.name = "fashion_mnist"
  config.data.data_dir = ""
  config.data.partition = "dirichlet_fixed_size"
  config.data.partition_file = ""
  config.data.num_clients = 300
  config.data.alpha = 0.1
  config.data.samples_per_client = 200
  config.data.classes_per_client = 2
  config.data.keep_per_client = 0
  config.data.max_train = 0
  config.data.max_test = 0

  config.model = ml_collections.ConfigDict()
  config.model.name = "mlp"
  config.model.hidden = (100,)
  config.model.activation = "relu"
  config.model.init = "shared"
  config.model.module = ""
  config.model.per_sample = False

  config.topology = ml_collections.ConfigDict()
  config.topology.name = "regular"
  config.topology.degree = 5
  config.topology.p = 0.0
  config.topology.mean_degree = 5.0
  config.topology.cluster_size = 6
  config.topology.dynamic = True
  config.topology.k_max = 0
  config.topology.mixing = "uniform"

  config.eval = ml_collections.ConfigDict()
  config.eval.every = 1
  config.eval.clients_every = 1
  config.eval.targets = (0.80, 0.85)
  config.eval.selection = True
  config.eval.stop_at = 0.0
  config.eval.batch_size = 10_000
  config.eval.consensus = False

  config.checkpoint_every = 5
  config.checkpoint_keep = ()
  config.on_divergence = "stop"
  config.chunk_size = 0
  config.devices = 0
  config.replicas = 1
  config.replica_chunk = 1
  config.debug_clients = False
  config.cost_estimate = True
  config.algorithm = ml_collections.ConfigDict()
  return config


def smoke_slice(config: ml_collections.ConfigDict, *, rounds: int = 2) -> ml_collections.ConfigDict:
  """The common part of every method's ``smoke`` variant: seconds on a slice of the data.

  A 6,000-sample training slice split over 20 clients of ≈100 samples, degree-2
  graphs, a 2,000-sample test slice scored in one batch and a checkpoint every
  round (so the smoke runs exercise checkpointing too). With the CNN (the ``cnn``
  variant, before or after ``smoke``) the slice is smaller (:func:`_fit_smoke_to_model`), so that
  the smoke run keeps the MLP smoke run's order of time.
  """
  config.rounds = rounds
  config.data.max_train = _SMOKE_MAX_TRAIN
  config.data.max_test = 2_000
  config.data.num_clients = 20
  config.data.samples_per_client = 100
  config.topology.degree = 2
  config.eval.batch_size = 2_000
  config.checkpoint_every = 1
  _fit_smoke_to_model(config)
  return config


_SMOKE_MAX_TRAIN = 6_000
SMOKE_CNN_SAMPLES = 10
"""Samples per client of a smoke run with the CNN (the MLP's smoke run has 100)."""
SMOKE_CNN_CLIENTS = 10
"""Clients of a smoke run with the CNN (the MLP's smoke run has 20)."""
SMOKE_CNN_TEST = 200
"""Test images a smoke run with the CNN scores, in one batch (the MLP's smoke run scores 2,000)."""


def _fit_smoke_to_model(config) -> None:
  """A smoke slice (recognised by its 6,000-sample training slice) with the CNN: fewer clients, samples
  per client and test images.

  A CNN forward pass costs 8.3 MFLOP per image against the MLP's 0.16 MFLOP (52x), and its kernel is
  dominated by the ``N·C`` backward passes through the convolutions: on the full smoke slice one
  NTK-DFL round took minutes on a CPU, and scoring every client's model on 2,000 images alone cost more
  than the MLP's whole run. Every stage still runs (kernels, steps, evaluation of the aggregate, the
  clients and the consensus, checkpoints); 200 test images cover every class.

  Clients (and ensemble modes) are trained and scored one at a time (``chunk_size = 1``): a convolution
  vmapped over clients is a grouped convolution, which XLA's CPU backend runs several times slower than
  the clients' convolutions one by one.
  """
  if config.model.name == "cnn" and config.data.max_train == _SMOKE_MAX_TRAIN:
    config.data.samples_per_client = min(config.data.samples_per_client, SMOKE_CNN_SAMPLES)
    config.data.num_clients = min(config.data.num_clients, SMOKE_CNN_CLIENTS)
    config.data.max_test = min(config.data.max_test, SMOKE_CNN_TEST)
    config.eval.batch_size = min(config.eval.batch_size, SMOKE_CNN_TEST)
    config.chunk_size = 1
    if "batch_size" in config.algorithm:
      config.algorithm.batch_size = min(config.algorithm.batch_size, config.data.samples_per_client)


def _set_alpha(config, alpha: float) -> None:
  config.data.partition = "dirichlet_fixed_size"
  config.data.alpha = alpha


def _set_iid(config) -> None:
  config.data.partition = "iid"


def _set_static(config) -> None:
  config.topology.dynamic = False


def _set_contiguous(config) -> None:
  config.data.partition = "contiguous"


def _set_authors_map(config, token: str) -> None:
  """``authors_alpha<α>[_d<draw>]`` / ``authors_iid[_d<draw>]``: the shipped map, draw 0 by default."""
  from ntk_fl._src.names import VENDORED_DATASET, authors_map_name  # pylint: disable=import-outside-toplevel

  level, _, draw = token[len("authors_") :].partition("_d")
  if draw and not draw.isdigit():
    raise ValueError(f"variant {token!r}: the draw must be a number, e.g. 'authors_alpha0.1_d3'")
  if level != "iid" and not level.startswith("alpha"):
    raise ValueError(
      f"variant {token!r}: expected authors_alpha<α>[_d<draw>] or authors_iid[_d<draw>]"
    )
  alpha = None if level == "iid" else level[len("alpha") :]
  try:
    name = authors_map_name("iid" if alpha is None else alpha, int(draw or 0))
  except ValueError as e:
    raise ValueError(f"variant {token!r}: {e}") from None
  config.data.name = VENDORED_DATASET
  config.data.partition = "index_map"
  config.data.partition_file = name
  config.data.num_clients = 300
  if alpha is not None:
    config.data.alpha = float(alpha)  # a label only: the map is the partition


def _set_cnn(config) -> None:
  config.model.name = "cnn"
  _fit_smoke_to_model(config)


def _set_femnist_digits(config) -> None:
  # FEMNIST's digits, one client per writer (NTK-DFL Fig. 10a, NTK-FL Fig. 4).
  config.data.name = "femnist_digits"
  config.data.partition = "by_writer"


COMMON_VARIANTS = {
  "paper": lambda config: None,
  "cnn": _set_cnn,
  "iid": _set_iid,
  "static": _set_static,
  "mnist": lambda config: setattr(config.data, "name", "mnist"),
  "contiguous": _set_contiguous,
  "femnist_digits": _set_femnist_digits,
}
"""Variant tokens every method's config understands, plus ``alpha<float>`` (e.g. ``alpha0.5``) and the
authors' shipped Fashion-MNIST partitions ``authors_alpha<α>[_d<draw>]`` (α ∈ {0.1, ..., 0.5}, draws
0-4) and ``authors_iid[_d<draw>]`` (draws 0-2); without ``_d`` the draw is 0, the one the authors' code
uses. ``contiguous``: client ``i`` holds samples ``[200 i, 200 i + 200)``, the NTK-FL code's fallback.
``cnn``: the papers' CNN (:func:`ntk_fl.models.cnn`, conv32-pool-conv64-pool-fc100-fc10) on unflattened
images instead of the MLP; with ``smoke``, :data:`SMOKE_CNN_CLIENTS` clients of :data:`SMOKE_CNN_SAMPLES`
samples and :data:`SMOKE_CNN_TEST` test images.
``femnist_digits``: FEMNIST's digit samples, one client per writer (LEAF files, see :mod:`ntk_fl.data`)."""


def apply_variants(
  config: ml_collections.ConfigDict, arg: str | None, method_variants=None, valued_variants=None
):
  """Applies the comma-separated variant tokens of ``--config=file.py:tok1,tok2``.

  Tokens are applied left to right: ``COMMON_VARIANTS``, ``alpha<float>`` (the
  authors' fixed-size Dirichlet generator with that concentration, a fresh draw
  from the seed), ``authors_alpha<float>[_d<draw>]`` / ``authors_iid[_d<draw>]``
  (the authors' own shipped partition files), the method's own
  ``method_variants`` (name -> ``fn(config)``, which win over common ones of the
  same name) and its ``valued_variants`` (prefix -> ``fn(config, value_text)``
  for tokens ``<prefix><value>``, e.g. ``topk0.5``; ``fn`` checks the value). An
  unknown token raises ``ValueError`` listing the choices, so a typo never runs
  the default setting silently.
  """
  variants = {**COMMON_VARIANTS, **(method_variants or {})}
  valued = dict(valued_variants or {})
  for token in filter(None, (t.strip() for t in (arg or "").split(","))):
    prefix = next(
      (
        p
        for p in sorted(valued, key=len, reverse=True)
        if token.startswith(p) and len(token) > len(p)
      ),
      None,
    )
    if token in variants:
      variants[token](config)
    elif prefix is not None:
      valued[prefix](config, token[len(prefix) :])
    elif token.startswith("authors_"):
      _set_authors_map(config, token)
    elif token.startswith("alpha"):
      try:
        alpha = float(token[len("alpha") :])
      except ValueError:
        alpha = float("nan")
      if not alpha > 0:
        raise ValueError(f"variant {token!r}: alpha must be a positive number, e.g. 'alpha0.5'")
      _set_alpha(config, alpha)
    else:
      extra = "".join(f", {p}<value>" for p in sorted(valued))
      raise ValueError(
        f"unknown config variant {token!r}; known: {', '.join(sorted(variants))}, alpha<float>, "
        f"authors_alpha<float>[_d<draw>], authors_iid[_d<draw>]{extra}"
      )
  return config


def load_config(path: str, variant: str | None = None) -> ml_collections.ConfigDict:
  """``get_config(variant)`` of a config -- what ``--config=path:variant`` gives, from Python.

  ``path`` is a config file or the name of a packaged config (``"ntk_dfl"``, see
  :mod:`ntk_fl.configs`).
  """
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel

  from ntk_fl import configs  # pylint: disable=import-outside-toplevel

  file = pathlib.Path(configs.resolve(str(path)))
  if not file.is_file():
    raise FileNotFoundError(f"config file {str(file)!r} does not exist")
  spec = importlib.util.spec_from_file_location(f"ntk_fl_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {str(file)!r} defines no get_config(arg)")
  return module.get_config(variant)
