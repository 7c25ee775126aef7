"""Golden smoke runs: every method's ``smoke`` run reduced to a small record, stored under ``tests/golden/``.

The record of a run keeps, per round, what a change to the numerics would move: the aggregated
model's test accuracy and loss, the mean (and consensus) client accuracy, the mean training loss
and communicated bits, and each client's chosen τ and training loss where the method reports them.
``tests/test_golden.py`` reruns every smoke config in-process and compares with these files.

Regenerate (only when a change is *meant* to move results, and say so in the commit):

  PYTHONPATH=$PWD python tests/golden_runs.py            # every config with a smoke variant
  PYTHONPATH=$PWD python tests/golden_runs.py spark      # one config (all its runs)
  PYTHONPATH=$PWD python tests/golden_runs.py spark-proj500-compressed   # one run

Float32 results of XLA's CPU backend are deterministic on one machine but depend on the CPU: the
code it generates follows the instruction set (AVX2 against AVX-512: vector widths, hence the order of
a reduction's sums) and the matrix products' blocking follows the caches. A few runs, chaotic enough to
carry that difference past the test's rounding tolerances, therefore have a second record, made on a
CPU of another kind, in a folder of ``tests/golden/`` named after it (``PLATFORM.json`` there says
which CPU): ``tests/test_golden.py`` accepts a run that matches the record of any CPU kind. Record
another kind's files on such a machine, keeping only the runs that differ from the main record:

  PYTHONPATH=$PWD python tests/golden_runs.py --platform NAME [runs...]
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO / "tests" / "golden"
CONFIG_DIR = REPO / "ntk_fl" / "configs"

# Per round: scalars kept from the metrics line (absent ones are skipped), and per-client arrays kept from
# its "clients" block. The rest (timings, min/max of the kept arrays, per-client test accuracy) follows from
# these or from the wall clock.
ROUND_SCALARS = (
  "test_acc",
  "test_loss",
  "client_acc_mean",
  "client_loss_mean",
  "consensus_acc_mean",
  "loss_mean",
  "bits_cumulative",
  "lr",
)
CLIENT_ARRAYS = ("tau", "loss")


# Beyond each method's smoke run, the smoke runs of the variants that take the NTK step's other branches:
# Jacobian batching and data subsampling, the MSE closed form, SPARK's layer-wise sketch (structured kernel in
# sketch coordinates) and that sketch with the compression stack (explicit J̃ from the dense stack's factors,
# sparsified and quantised per package) and sub-sampling, the server materialising J with linearised τ
# selection, CP-NTK-FL's compression, Fed-ensemble's NTK modes, NTK-DFL's App. E.3 compression stack (explicit
# compressed Jacobians of a projected model), SPARK's Option B (Jacobians at the senders' own weights), the
# Adam client optimiser, NTK-FL's τ scored on held-out validation clients, Fed-ensemble's straggler
# over-selection, FedBE's SWAG sampler, NTK-DFL, NTK-FL, CP-NTK-FL, SPARK and Fed-ensemble with the CNN (the
# layer-wise structured kernel, the convolutions' weight gradients from their patches in the NTK step
# and in Fed-ensemble's SGD clients; a few clients, samples, rounds and test images, so that their
# compilation and rounds fit a test; the server methods and Fed-ensemble with two participants a
# round), and FedAvg' (FedAvg on CP-NTK-FL's subsampled, projected inputs).
# (SPARK's ``full_stack`` itself holds a 79,510 x 10,000 flattened sketch, 3.2 GB: too big for a test.)
EXTRA_VARIANTS = (
  ("ntk_dfl", "smoke,batched,subsample"),
  ("ntk_dfl", "smoke,mse"),
  ("ntk_dfl", "smoke,topk0.5,bits6,subsample,proj20,clustered"),
  ("spark", "smoke,proj500"),
  ("spark", "smoke,proj500,compressed"),
  ("spark", "smoke,option_b,compressed"),
  ("ntk_fl", "smoke,explicit,linearized"),
  ("cp_ntk_fl", "smoke,table1"),
  ("cp_ntk_fl", "smoke,table1,shuffle"),
  ("fed_ensemble", "smoke,ntk"),
  ("fedavg", "smoke,adam"),
  ("fed_ensemble", "smoke,stragglers"),
  ("ntk_fl", "smoke,validation"),
  ("ntk_dfl", "smoke,cnn,few"),
  ("ntk_fl", "smoke,cnn,few,two_per_round"),
  ("cp_ntk_fl", "smoke,cnn,few,two_per_round"),
  ("spark", "smoke,cnn,few,one_round"),
  ("fed_ensemble", "smoke,cnn,few,two_per_round,shards5"),
  ("fedavg", "smoke,fig3"),
  ("fedbe", "smoke,swag"),
)


# Variant tokens of these runs that no config file defines: config fields set after loading.
OVERRIDES = {
  "compressed": {
    "algorithm.compression.keep_fraction": 0.5,
    "algorithm.compression.bits": 6,
    "algorithm.subsample": 5,
  },
  "few": {
    "data.num_clients": 4,
    "data.samples_per_client": 8,
    "rounds": 2,
    "data.max_test": 250,
    "eval.batch_size": 250,
  },
  # The server methods' and Fed-ensemble's participants per round, within ``few``'s 4 clients.
  "two_per_round": {"algorithm.clients_per_round": 2},
  # Fed-ensemble's shard partition (two classes a client) needs 5 clients for 10 classes; it ignores
  # samples_per_client, so the training slice is cut instead (5 clients of 200 samples).
  "shards5": {"data.num_clients": 5, "data.max_train": 1_000},
  # SPARK's CNN run's second round (its first with distillation) did not repeat from one run to the
  # next on one machine (identical first rounds; then one client's τ 50 or 100 and client losses apart
  # by orders of magnitude), so only one round is kept, distilling from its start.
  "one_round": {"rounds": 1, "algorithm.distill.warmup_rounds": 0},
}


def smoke_configs() -> list[str]:
  """The config files of runner methods (names without ``.py``); every one has a ``smoke`` variant.

  Configs of programs other than the runner (the Fed-ensemble toy regression, run by its own script) name a
  ``method`` that is not registered and have no smoke run to record.
  """
  from ntk_fl import algorithms
  from ntk_fl.config import load_config

  methods = set(algorithms.available())
  return sorted(
    p.stem
    for p in CONFIG_DIR.glob("*.py")
    if not p.stem.startswith("_") and load_config(str(p)).method in methods
  )


def golden_runs() -> list[tuple[str, str]]:
  """Every (config name, variant) with a golden file."""
  return [(name, "smoke") for name in smoke_configs()] + list(EXTRA_VARIANTS)


def record(name: str, variant: str = "smoke") -> dict:
  """Runs ``configs/<name>.py:<variant>`` through the runner in a temporary workdir; returns its record."""
  from ntk_fl import rundir, runner
  from ntk_fl.config import load_config

  tokens = variant.split(",")
  config = load_config(
    str(CONFIG_DIR / f"{name}.py"), ",".join(t for t in tokens if t not in OVERRIDES)
  )
  for token in tokens:
    config.update_from_flattened_dict(OVERRIDES.get(token, {}))
  # None changes a metric: checkpoints are written after the round's line, selection curves after the run,
  # and the cost estimate before round 1 only logs (tests/test_cost.py checks it and the switch).
  config.checkpoint_every = 0
  config.checkpoint_keep = ()
  config.eval.selection = False
  config.cost_estimate = False
  with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as workdir:
    runner.run(config, workdir)
    lines = rundir.read_metrics(workdir)
  rounds = []
  for line in lines:
    kept = {"round": line["round"]}
    kept.update((k, line[k]) for k in ROUND_SCALARS if k in line)
    clients = line.get("clients", {})
    kept.update((f"clients_{k}", clients[k]) for k in CLIENT_ARRAYS if k in clients)
    rounds.append(kept)
  return {"config": f"{name}.py:{variant}", "rounds": rounds}


def path(name: str, variant: str = "smoke", platform: str = "") -> pathlib.Path:
  """The record of a run: ``tests/golden/<stem>.json``, or a CPU kind's in ``tests/golden/<platform>/``."""
  suffix = "" if variant == "smoke" else "-" + variant.removeprefix("smoke,").replace(",", "-")
  return (GOLDEN_DIR / platform if platform else GOLDEN_DIR) / f"{name}{suffix}.json"


def records(name: str, variant: str = "smoke") -> dict[str, pathlib.Path]:
  """Every record of a run, by CPU kind: ``""`` for the main one, then each platform folder's."""
  found = {"": path(name, variant)}
  for folder in sorted(p for p in GOLDEN_DIR.iterdir() if p.is_dir()):
    candidate = path(name, variant, folder.name)
    if candidate.exists():
      found[folder.name] = candidate
  return found


def cpu_description() -> dict:
  """What identifies this machine's CPU for XLA's code generation (Linux ``/proc/cpuinfo``)."""
  fields, flags = {}, []
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
    key, _, value = (part.strip() for part in line.partition(":"))
    if (
      key in ("vendor_id", "model name", "cpu family", "model", "cache size") and key not in fields
    ):
      fields[key] = value
    elif key == "flags" and not flags:
      flags = sorted(f for f in value.split() if f.startswith(("avx", "fma", "sse4")))
  return {**fields, "vector flags": flags}


def dumps(rec: dict) -> str:
  """One round per line: small files whose diffs show which round moved."""
  rounds = ",\n  ".join(json.dumps(r) for r in rec["rounds"])
  return f'{{"config": {json.dumps(rec["config"])},\n "rounds": [\n  {rounds}\n ]}}\n'


def main(names: list[str], platform: str = "") -> None:
  """Regenerates the golden files of ``names`` (config names or file stems; all when empty).

  With ``platform``, writes this CPU kind's records to ``tests/golden/<platform>/`` instead, only for
  the runs whose result differs from the main record beyond ``tests/test_golden.py``'s tolerances.
  """
  import test_golden  # pylint: disable=import-outside-toplevel  (its tolerances decide what differs)

  folder = GOLDEN_DIR / platform if platform else GOLDEN_DIR
  folder.mkdir(exist_ok=True)
  if platform:
    (folder / "PLATFORM.json").write_text(json.dumps(cpu_description(), indent=1) + "\n")
  for name, variant in golden_runs():
    if names and name not in names and path(name, variant).stem not in names:
      continue
    rec = record(name, variant)
    assert json.loads(dumps(rec)) == rec
    if platform:
      try:
        test_golden.compare(f"{name}:{variant}", json.loads(path(name, variant).read_text()), rec)
        print(f"{path(name, variant).stem}: matches the main record; none written")
        continue
      except AssertionError:
        pass
    target = path(name, variant, platform)
    target.write_text(dumps(rec))
    print(f"wrote {target.relative_to(REPO)}")


if __name__ == "__main__":
  args = sys.argv[1:]
  chosen_platform = ""
  if args[:1] == ["--platform"]:
    if len(args) < 2 or not args[1] or "/" in args[1]:
      raise SystemExit("error: --platform needs a folder name, e.g. --platform amd-epyc-avx2")
    chosen_platform, args = args[1], args[2:]
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  main(args, chosen_platform)
