"""ntk_fl.reproduce: the registry's integrity, the resumable queue, rendering from runs, and one
real queue."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from ntk_fl import rundir, schema
from ntk_fl import reproduce
from ntk_fl.reproduce import EXPERIMENTS, costs, estimate, list_table, queue, render
from ntk_fl.reproduce.experiments import SMOKE
from ntk_fl.reproduce.queue import config_key, stored_form
from ntk_fl.reproduce.registry import Experiment, Variant, build_config, override_flags

CAMPAIGN = [
  "ntk_dfl:fig9",
  "ntk_dfl:fig8",
  "ntk_dfl:fig11",
  "ntk_dfl:fig12",
  "ntk_dfl:fig13",
  "ntk_dfl:fig14",
  "ntk_dfl:fig3_sparsity",
  "ntk_dfl:fig3_heterogeneity",
  "ntk_dfl:fig10b",
  "ntk_dfl:fig10c",
  "spark:table3",
  "spark:table4",
  "spark:fig5",
  "spark:fig6a",
  "spark:fig6b",
  "spark:fig7",
  "ntk_fl:fig6",
  "ntk_fl:fig5",
  "ntk_fl:fig3",
]
KINDS = {"rounds", "accuracy", "sweep", "paired", "communication", "selection"}


# ----------------------------------------------------------------------------- the registry


def _all_variants():
  return [(e, v) for e in EXPERIMENTS.values() for v in e.variants]


def test_the_campaign_and_every_paper_is_registered():
  assert set(CAMPAIGN) <= set(EXPERIMENTS)
  papers = {name.split(":")[0] for name in EXPERIMENTS}
  assert papers == {"ntk_dfl", "ntk_fl", "spark", "fed_ensemble", "smoke"}
  assert [v.x for v in EXPERIMENTS["ntk_dfl:fig9"].variants] == [2, 3, 4, 5, 6]
  assert [v.name for v in EXPERIMENTS["ntk_dfl:fig9"].variants][
    0
  ] == "fig9_ntk_dfl_k2"  # the campaign's names
  for name in ("ntk_dfl:fig10a", "spark:fig13", "ntk_fl:fig7"):
    assert EXPERIMENTS[name].needs and not EXPERIMENTS[name].variants


def test_every_experiment_is_consistent():
  for experiment in EXPERIMENTS.values():
    assert experiment.kind in KINDS, experiment.name
    assert experiment.variants or experiment.needs or experiment.script, (
      f"{experiment.name}: no runs and nothing it needs"
    )
    names = [v.name for v in experiment.variants]
    assert len(names) == len(set(names)), f"{experiment.name}: a variant twice"
    for a, b in experiment.pairs:
      experiment.variant(a), experiment.variant(b)
    for v in experiment.variants:
      if v.branch_from:
        experiment.variant(v.branch_from)
      if experiment.kind == "sweep":
        assert v.x is not None, f"{experiment.name}/{v.name} has no x"


def test_every_variant_builds_and_validates_and_names_one_config():
  by_name, by_key = {}, {}
  for experiment, variant in _all_variants():
    seed = experiment.seeds_of(variant)[0]
    config = build_config(variant, seed)
    schema.validate_config(config)  # raises naming the bad field
    key = config_key(stored_form(config))
    assert by_name.setdefault(variant.name, key) == key, f"{variant.name} names two configs"
    assert by_key.setdefault(key, variant.name) == variant.name, (
      f"{variant.name} and {by_key[key]} are the same run under two names"
    )


def test_an_override_of_a_missing_field_is_refused():
  with pytest.raises(
    ValueError, match="override topology.degre: config ntk_dfl has no field topology.degre"
  ):
    build_config(Variant("x", "ntk_dfl", (("topology.degre", 2),)), 0)


def test_override_flags_parse_back_to_the_same_config(tmp_path):
  variant = Variant(
    "v",
    "spark:smoke",
    (
      ("checkpoint_keep", (2,)),
      ("algorithm.momentum", 0.5),
      ("topology.dynamic", False),
      ("topology.name", "ring"),
    ),
  )
  assert override_flags(variant) == [
    "--config.checkpoint_keep=(2,)",
    "--config.algorithm.momentum=0.5",
    "--config.topology.dynamic=False",
    "--config.topology.name=ring",
  ]


def test_estimates_follow_the_cost_table():
  fig9 = estimate(EXPERIMENTS["ntk_dfl:fig9"])
  cost = costs.ROUND_SECONDS["ntk_dfl"]
  step = cost.cpu - cost.cpu_eval
  expected = sum(30 * (step * ((k + 1) / 6) ** 2 + cost.cpu_eval) for k in (2, 3, 4, 5, 6)) / 3600
  assert fig9["runs"] == 5 and fig9["cpu_h"] == pytest.approx(expected)
  assert fig9["gpu_h"] == pytest.approx(
    sum(30 * cost.gpu * ((k + 1) / 6) ** 2 for k in (2, 3, 4, 5, 6)) / 3600
  )
  text = list_table()
  assert "| ntk_dfl:fig9 |" in text and "needs data: CIFAR-10" in text and "smoke:" not in text
  with pytest.raises(ValueError, match="no per-round cost for method 'nope'"):
    costs.estimate({"method": "nope", "rounds": 1})


def test_compressed_gossip_runs_are_costed_from_the_measured_compressed_round():
  """``ntk_dfl:compressed`` is the measured row itself; unprojected top-k and no subsampling (Fig. 15's
  first stack) hold 5x the neighbourhood samples and 3.77x the parameters; uncompressed runs keep the
  kernel row."""
  plain = build_config(Variant("ntk_dfl", "ntk_dfl", ()), 0)
  compressed = build_config(Variant("ntk_dfl_c", "ntk_dfl:compressed", ()), 0)
  topk = build_config(Variant("ntk_dfl_t", "ntk_dfl:topk0.5", ()), 0)
  as_dict = stored_form
  assert not costs.transmits_jacobians(as_dict(plain))
  assert costs.transmits_jacobians(as_dict(compressed)) and costs.transmits_jacobians(as_dict(topk))
  row = costs.TRANSMITTED_ROUND
  cpu, _, measured = costs.estimate(as_dict(compressed))
  assert cpu == pytest.approx(compressed.rounds * row.cpu) and not measured
  assert costs.round_scale(as_dict(topk)) == pytest.approx(5 * 79_510 / 21_110)
  assert costs.estimate(as_dict(plain))[0] == pytest.approx(
    plain.rounds * costs.ROUND_SECONDS["ntk_dfl"].cpu
  )
  # The compressed stack costs more per round than plain NTK-DFL on the CPU, as measured (4.6x).
  assert costs.estimate(as_dict(compressed))[0] > 4 * costs.estimate(as_dict(plain))[0]


def test_datashare_is_costed_by_its_participants_data_with_the_shared_set():
  """A DataShare participant's epochs run over its ≈ 200 samples plus ``share_fraction`` of all
  clients' samples: at the paper's 10 % of 300 clients, 31 FedAvg-sized passes, the measured row; a
  set twice as large costs (1 + 60) / 31 of it, and half the clients (1 + 15) / 31."""

  def per_round(*overrides):
    config = stored_form(build_config(Variant("ds", "datashare", overrides), 0))
    return costs.estimate(config)[0] / config["rounds"]

  row = costs.ROUND_SECONDS["datashare"]
  assert per_round() == pytest.approx(row.cpu)
  step = row.cpu - row.cpu_eval
  assert per_round(("algorithm.share_fraction", 0.2)) == pytest.approx(
    step * 61 / 31 + row.cpu_eval
  )
  assert per_round(("data.num_clients", 150)) == pytest.approx(step * 16 / 31 + row.cpu_eval)
  # FedAvg's participants train on their own samples only: 31x fewer minibatches, so the two measured
  # rows' steps (evaluation aside) agree with that ratio to within measurement noise.
  fedavg = costs.ROUND_SECONDS["fedavg"]
  assert step / (fedavg.cpu - fedavg.cpu_eval) == pytest.approx(31, rel=0.1)


def _erdos_renyi_config(method="ntk_dfl", chunk=1):
  er = (("topology.name", "erdos_renyi"), ("topology.mean_degree", 5.0), ("chunk_size", chunk))
  return stored_form(build_config(Variant("er", method, er), 0))


def test_erdos_renyi_runs_are_costed_by_their_padded_neighbour_slots():
  """A round that pads every client's NTK block to the topology's ``k_max`` (all clients at once, or
  SPARK, whose client update is per slot): for an Erdős–Rényi graph the degree bound (from the binomial
  tail, independent of the estimate), not the mean degree."""
  from scipy import stats  # pylint: disable=import-outside-toplevel

  # The smallest k with 300 * P(Binomial(299, 5/299) > k) < 1e-6, by a plain loop.
  bound = next(k for k in range(300) if 300 * stats.binom.sf(k, 299, 5 / 299) < 1e-6)
  assert bound > 5
  for method in ("ntk_dfl", "spark"):
    padded, regular = (
      _erdos_renyi_config(method, chunk=0),
      build_config(Variant("k5", method, ()), 0),
    )
    assert not costs.groups_by_degree(padded)
    ratio = costs.round_scale(padded) / costs.round_scale(stored_form(regular))
    assert ratio == pytest.approx(((bound + 1) / 6) ** 2)


@pytest.mark.parametrize("method", ["ntk_dfl", "spark"])
def test_erdos_renyi_runs_in_chunks_are_costed_by_their_degree_groups(method):
  """NTK-DFL and SPARK mapped in chunks give each client its degree group's slots: the mean over round
  0's clients of (1 + slots)², by a plain loop over the drawn degrees; SPARK's compressed packages keep
  k_max slots."""
  from ntk_fl import topology  # pylint: disable=import-outside-toplevel

  grouped = _erdos_renyi_config(method)
  assert costs.groups_by_degree(grouped)
  graphs = topology.make_topology("erdos_renyi", 300, seed=0, mean_degree=5.0)
  groups = topology.degree_slot_groups(graphs)
  members = []
  for degree in np.asarray(graphs.sample(0).mask).sum(axis=1):
    members.append(1 + next(g for g in groups if g >= degree))
  regular = stored_form(build_config(Variant("k5", method, ()), 0))
  ratio = costs.round_scale(grouped) / costs.round_scale(regular)
  assert ratio == pytest.approx(np.mean(np.square(members)) / 36)
  padded = _erdos_renyi_config(method, chunk=0)
  assert ratio < 0.2 * costs.round_scale(padded) / costs.round_scale(regular)
  if method == "spark":
    packed = dict(grouped, algorithm=dict(grouped["algorithm"]))
    packed["algorithm"]["compression"] = dict(
      grouped["algorithm"]["compression"], keep_fraction=0.5
    )
    assert not costs.groups_by_degree(packed)
    assert costs.round_scale(packed) == pytest.approx(costs.round_scale(padded))


def test_projection_alone_is_costed_and_grouped_as_the_uncompressed_round():
  """The input projection without top-k or quantisation keeps NTK-DFL's round matrix-free and its
  client update independent of the slot count (``NTKDFLHParams.compressed`` is False), so the estimate
  takes the uncompressed row and, on an Erdős–Rényi graph mapped in chunks, the degree groups, as the
  round does; adding top-k to it switches both off."""
  from ntk_fl.algorithms import ntk_dfl  # pylint: disable=import-outside-toplevel

  projected = build_config(Variant("p", "ntk_dfl:proj200", ()), 0)
  plain = build_config(Variant("k5", "ntk_dfl", ()), 0)
  assert projected.algorithm.projection_dim == 200
  assert not ntk_dfl.NTKDFLHParams(**projected.algorithm.to_dict()).compressed
  assert not costs.transmits_jacobians(stored_form(projected))
  assert costs.estimate(stored_form(projected)) == costs.estimate(stored_form(plain))
  er = (("topology.name", "erdos_renyi"), ("topology.mean_degree", 5.0), ("chunk_size", 1))
  projected_er = stored_form(build_config(Variant("p_er", "ntk_dfl:proj200", er), 0))
  assert costs.groups_by_degree(projected_er)
  assert costs.round_scale(projected_er) == pytest.approx(costs.round_scale(_erdos_renyi_config()))
  compressed_er = stored_form(build_config(Variant("c_er", "ntk_dfl:topk0.5,proj200", er), 0))
  assert costs.transmits_jacobians(compressed_er) and not costs.groups_by_degree(compressed_er)


# ----------------------------------------------------------------------------- the queue (a stand-
# in launcher)


def _flag(command, name):
  return next(c.split("=", 1)[1] for c in command if c.startswith(f"--{name}="))


class FakeLauncher:
  """Plays ``ntk-fl``: writes the run's config (as the command builds it), rounds, a checkpoint and
  a summary."""

  def __init__(self, experiment, finish=True, fail=()):
    self.experiment, self.finish, self.fail, self.commands = experiment, finish, set(fail), []

  def __call__(self, command, log_path):
    self.commands.append(command)
    workdir, seed = _flag(command, "workdir"), int(_flag(command, "config.seed"))
    spec = _flag(command, "config")
    # The variant's own overrides (a resume also passes the stored neutral keys: placement, cadence).
    overrides = [
      c
      for c in command
      if c.startswith("--config.")
      and c[len("--config.") :].split("=")[0] not in rundir.NEUTRAL_KEYS
    ]
    variant = next(
      v for v in self.experiment.variants if v.config == spec and override_flags(v) == overrides
    )
    if variant.name in self.fail:
      return 1
    os.makedirs(os.path.join(workdir, "checkpoints", "1"), exist_ok=True)
    with open(os.path.join(workdir, rundir.CONFIG_FILE), "w") as f:
      json.dump(stored_form(build_config(variant, seed)), f)
    with open(os.path.join(workdir, rundir.METRICS_FILE), "a") as f:
      f.write(json.dumps({"round": 1, "step_time": 1.0, "test_acc": 0.5 + 0.01 * seed}) + "\n")
    if self.finish:
      with open(os.path.join(workdir, rundir.SUMMARY_FILE), "w") as f:
        json.dump({"rounds_run": 1}, f)
    return 0


def test_the_queue_starts_skips_resumes_and_moves_aside(tmp_path):
  out = str(tmp_path / "runs")
  launch = FakeLauncher(SMOKE)
  jobs = queue.run_queue(SMOKE, out, launch=launch, echo=lambda _: None)
  assert [(os.path.basename(j.workdir), j.action) for j in jobs] == [
    ("smoke_lr01_s0", "start"),
    ("smoke_lr03_s0", "start"),
  ]
  assert not any("--resume" in c for c in launch.commands[0])
  assert (
    "--config.algorithm.lr=0.03" in launch.commands[1] and "--config.rounds=2" in launch.commands[1]
  )
  # Everything finished: nothing runs.
  launch = FakeLauncher(SMOKE)
  assert [j.action for j in queue.run_queue(SMOKE, out, launch=launch, echo=lambda _: None)] == [
    "skip",
    "skip",
  ]
  assert launch.commands == []
  # Interrupted after a checkpoint: resumed in place. Killed before its first finalised checkpoint:
  # moved aside, restarted.
  os.remove(os.path.join(out, "smoke_lr01_s0", rundir.SUMMARY_FILE))
  lr03 = os.path.join(out, "smoke_lr03_s0")
  os.remove(os.path.join(lr03, rundir.SUMMARY_FILE))
  # Its only save did not finish (orbax's temporary folder name starts with the step): not a checkpoint.
  os.rename(
    os.path.join(lr03, "checkpoints", "1"),
    os.path.join(lr03, "checkpoints", "1.orbax-checkpoint-tmp-1795800000"),
  )
  messages = []
  launch = FakeLauncher(SMOKE)
  jobs = queue.run_queue(SMOKE, out, launch=launch, echo=messages.append)
  assert [j.action for j in jobs] == ["resume", "start"]
  assert "--resume" in launch.commands[0] and _flag(launch.commands[0], "workdir") == os.path.join(
    out, "smoke_lr01_s0"
  )
  assert "--resume" not in launch.commands[1]
  aside = [d for d in os.listdir(out) if d.startswith("smoke_lr03_s0.unfinished-")]
  assert len(aside) == 1 and any("moved to" in m for m in messages)
  assert rundir.read_metrics(os.path.join(out, aside[0]))[0]["round"] == 1  # kept, not deleted
  # A moved-aside folder is never taken for the run, even when the run's own folder is gone.
  os.rename(os.path.join(out, "smoke_lr03_s0"), os.path.join(out, "smoke_lr03_s0.unfinished-1"))
  [job] = queue.plan(SMOKE, out, patterns=["smoke_lr03"])
  assert (job.action, job.workdir, job.aside) == ("start", lr03, "")


def test_a_run_with_the_same_config_under_another_name_is_found(tmp_path):
  out = tmp_path / "runs"
  queue.run_queue(SMOKE, str(out), launch=FakeLauncher(SMOKE), echo=lambda _: None)
  os.rename(out / "smoke_lr03_s0", out / "made_by_hand")
  launch = FakeLauncher(SMOKE)
  jobs = queue.run_queue(SMOKE, str(out), launch=launch, echo=lambda _: None)
  assert [j.action for j in jobs] == ["skip", "skip"] and jobs[1].workdir == str(
    out / "made_by_hand"
  )
  # Seeds and variant patterns select the runs; a pattern that matches nothing is an error.
  plan = queue.plan(SMOKE, str(out), seeds=[1, 2], patterns=["*lr03"])
  assert [(j.variant.name, j.seed, j.action) for j in plan] == [
    ("smoke_lr03", 1, "start"),
    ("smoke_lr03", 2, "start"),
  ]
  with pytest.raises(ValueError, match="pattern 'nothing' matches no variant of smoke:queue"):
    queue.plan(SMOKE, str(out), patterns=["nothing"])


def test_a_found_run_resumes_with_its_own_chunk_and_any_checkpoint_cadence(tmp_path):
  """A run the queue matches (e.g. started by hand with another chunk_size and checkpoint_every) resumes
  with its own chunk size (the stored value comes last on the command line, after --extra, and passes
  the resume check); the checkpoint cadence, which changes no result, is the command's, from --extra."""
  out = tmp_path / "runs"
  (variant,) = [v for v in SMOKE.variants if v.name == "smoke_lr01"]
  config = build_config(variant, 0)
  config.checkpoint_every, config.chunk_size = 3, 2  # neither is the variant's
  workdir = out / "made_by_hand"
  (workdir / "checkpoints" / "1").mkdir(parents=True)
  with open(workdir / rundir.CONFIG_FILE, "w") as f:
    json.dump(stored_form(config), f)
  extra = ["--config.chunk_size=0", "--config.checkpoint_every=1"]
  [job] = queue.plan(SMOKE, str(out), patterns=["smoke_lr01"], extra=extra)
  assert (job.action, job.workdir) == ("resume", str(workdir))
  assert job.command[-1] == "--config.chunk_size=2"
  # The command's config (the last flag of a key wins, as in ntk-fl) resumes the run.
  parsed = build_config(variant, 0)
  for flag in (c for c in job.command if c.startswith("--config.")):
    key, text = flag[len("--config.") :].split("=", 1)
    if key in ("chunk_size", "checkpoint_every"):
      setattr(parsed, key, int(text))
  assert (parsed.checkpoint_every, parsed.chunk_size) == (1, 2)
  # Without the stored chunk size the resume is refused (what the flag is for) ...
  with pytest.raises(ValueError, match=r"different config.*chunk_size: 2 -> "):
    rundir.check_workdir(build_config(variant, 0), str(workdir), resume=True)
  # ... with it the config is the run's (its fake checkpoint holds no arrays, so it starts at 0).
  assert rundir.check_workdir(parsed, str(workdir), resume=True) == 0


def test_runs_with_long_rounds_checkpoint_every_round(tmp_path):
  """A run estimated at LONG_ROUND_SECONDS or more a round (NTK-DFL in the paper setting, its compressed
  stack) gets --config.checkpoint_every=1 before --extra (which still decides); DFedAvg's short rounds
  keep their config's cadence."""
  fig16 = EXPERIMENTS["ntk_dfl:fig16"]
  names = ("fig16_compressed_clustered", "fig9_ntk_dfl_k5", "fig3_dfedavg_k5")
  per_round = {}
  for name in names:
    config = build_config(fig16.variant(name), 0)
    assert config.checkpoint_every != 1
    per_round[name] = costs.estimate(stored_form(config))[0] / config.rounds
  assert per_round["fig16_compressed_clustered"] > per_round["fig9_ntk_dfl_k5"]
  assert per_round["fig9_ntk_dfl_k5"] >= queue.LONG_ROUND_SECONDS > per_round["fig3_dfedavg_k5"]
  jobs = {j.variant.name: j.command for j in queue.plan(fig16, str(tmp_path), patterns=names)}
  assert "--config.checkpoint_every=1" in jobs["fig16_compressed_clustered"]
  assert "--config.checkpoint_every=1" in jobs["fig9_ntk_dfl_k5"]
  assert not any("checkpoint_every" in c for c in jobs["fig3_dfedavg_k5"])
  [job] = queue.plan(
    fig16, str(tmp_path), patterns=[names[0]], extra=["--config.checkpoint_every=3"]
  )
  cadence = [c for c in job.command if c.startswith("--config.checkpoint_every=")]
  assert cadence == ["--config.checkpoint_every=1", "--config.checkpoint_every=3"]  # the last wins


def test_a_folder_at_the_run_name_with_another_config_is_moved_aside(tmp_path):
  out = tmp_path / "runs"
  (out / "smoke_lr01_s0" / "checkpoints" / "1").mkdir(parents=True)
  with open(out / "smoke_lr01_s0" / rundir.CONFIG_FILE, "w") as f:
    json.dump(stored_form(build_config(Variant("x", "ntk_dfl:smoke", (("rounds", 5),)), 0)), f)
  [job] = queue.plan(SMOKE, str(out), patterns=["smoke_lr01"])
  assert job.action == "start" and job.aside == str(out / "smoke_lr01_s0")


def test_branches_start_from_the_source_checkpoint_and_failures_do_not_stop_the_queue(tmp_path):
  experiment = Experiment(
    "t:branch",
    "branch",
    (
      Variant(
        "child", "ntk_dfl:smoke", (("rounds", 3),), branch_from="src"
      ),  # queued after its source
      Variant("src", "ntk_dfl:smoke", (("rounds", 2),)),
      Variant("bad", "ntk_dfl:smoke", (("rounds", 2), ("algorithm.lr", 0.5))),
    ),
  )
  launch = FakeLauncher(experiment, fail={"bad"})
  jobs = queue.run_queue(experiment, str(tmp_path), launch=launch, echo=lambda _: None)
  assert [(j.variant.name, j.action) for j in jobs] == [
    ("src", "start"),
    ("bad", "failed"),
    ("child", "start"),
  ]
  assert _flag(launch.commands[2], "branch_from") == os.path.join(str(tmp_path), "src_s0")


# ----------------------------------------------------------------------------- rendering


def _fake_run(root, name, variant, seed, accuracies, client=None):
  """A run folder as the trainer leaves it; ``summary.json`` only once every configured round is
  logged (a shorter one reads as still running)."""
  workdir = os.path.join(root, name)
  os.makedirs(workdir)
  config = stored_form(build_config(variant, seed))
  config["checkpoint_every"] = 2  # a result-neutral difference, as the campaign's runs
  with open(os.path.join(workdir, rundir.CONFIG_FILE), "w") as f:
    json.dump(config, f)
  with open(os.path.join(workdir, rundir.METRICS_FILE), "w") as f:
    for r, acc in enumerate(accuracies, start=1):
      f.write(
        json.dumps(
          {
            "round": r,
            "step_time": 1.0,
            "test_acc": acc,
            "client_acc_mean": None if client is None else client[r - 1],
          }
        )
        + "\n"
      )
  if len(accuracies) >= config["rounds"]:
    rundir.write_summary(workdir, {"rounds_run": len(accuracies)})
  return workdir


def test_a_run_started_under_its_own_name_is_reported_as_started(tmp_path):
  """A queue's run that has written its config but no round yet is "started", not "another config"."""
  fig12 = EXPERIMENTS["ntk_dfl:fig12"]
  runs = tmp_path / "runs"
  young = _fake_run(
    runs, "fig12_ntk_dfl_per_client_s0", fig12.variant("fig12_ntk_dfl_per_client"), 0, []
  )
  _, missing = render.collect(fig12, render.dirs_of(str(runs)), seeds=[0])
  assert f"fig12_ntk_dfl_per_client_s0: started, no round logged yet ({young})" in missing
  assert not any("another config" in m for m in missing)


def test_fig9_renders_from_campaign_named_runs(tmp_path):
  fig9 = EXPERIMENTS["ntk_dfl:fig9"]
  runs = tmp_path / "runs"
  acc = {2: [0.80, 0.84], 3: [0.81, 0.85], 4: [0.82, 0.855]}
  for k, values in acc.items():
    _fake_run(
      runs,
      f"fig9_ntk_dfl_k{k}_s0",
      fig9.variant(f"fig9_ntk_dfl_k{k}"),
      0,
      values + [0.86] * 28,
      [v - 0.15 for v in values + [0.86] * 28],
    )
  _fake_run(
    runs, "fig9_ntk_dfl_k3_s0_copy", fig9.variant("fig9_ntk_dfl_k3"), 1, [0.5]
  )  # seed 1: not asked for
  _fake_run(
    runs,
    "fig9_ntk_dfl_k6_s0",
    fig9.variant("fig9_ntk_dfl_k6"),
    0,
    [0.80, 0.83, 0.84],
    [0.70, 0.72, 0.75],
  )  # still running at round 3
  other = fig9.variant("fig9_ntk_dfl_k5")
  _fake_run(
    runs,
    "fig9_ntk_dfl_k5_s0",
    Variant("o", "ntk_dfl", (("topology.degree", 5), ("algorithm.lr", 0.02))),
    0,
    [0.8],
  )
  result = render.render(fig9, render.dirs_of(str(runs)), str(tmp_path / "figs"))
  text = result["markdown"]
  assert (
    "| NTK-DFL | 2 | NTK-DFL, κ = 2 | 0 | 30 | 86.00 | 71.00 | 15.00 | 3.0 | gap ≈ 15 points |"
    in text
  )
  assert (
    "fig9_ntk_dfl_k5_s0: " + str(runs / "fig9_ntk_dfl_k5_s0") + " holds another config "
    "(algorithm.lr: 0.02, expected 0.01)"
  ) in text
  assert (
    "| NTK-DFL | 6 | NTK-DFL, κ = 6 | 0 | 3 (running) | 84.00 | 75.00 | 9.00 | 0 of 1 reached | — |"
    in text
  )
  assert "| 3 | NTK-DFL, κ = 3 | 0 | 30 |" in text
  # κ = 6's round-3 value stays in the table, marked, but off the round-30 figure, and is listed.
  assert (
    "Not on the sweep figure, short of round 30 (still running, or stopped early): "
    "NTK-DFL, κ = 6 (round 3)."
  ) in text
  assert (
    "Unfinished runs (read at their latest round):\n"
    f"- fig9_ntk_dfl_k6_s0: unfinished, round 3 of 30 ({runs / 'fig9_ntk_dfl_k6_s0'})"
  ) in text
  drawn = render._plot_sweep(fig9, result["groups"], str(tmp_path / "again"))
  assert drawn["NTK-DFL"]["x"] == [2, 3, 4]
  assert drawn["NTK-DFL"]["left_off"] == [("NTK-DFL, κ = 6", 3)]
  assert {os.path.basename(f) for f in result["files"]} == {
    "ntk_dfl_fig9.md",
    "ntk_dfl_fig9.png",
    "ntk_dfl_fig9.pdf",
    "ntk_dfl_fig9_curves.png",
    "ntk_dfl_fig9_curves.pdf",
  }
  assert other.name not in result["groups"]


def test_sweep_plot_data_and_paired_rows_match_numpy_and_scipy(tmp_path):
  a = Variant("a", "ntk_dfl:smoke", (("rounds", 3),), "A", x=1, series="S")
  b = Variant(
    "b",
    "ntk_dfl:smoke",
    (("rounds", 3), ("algorithm.lr", 0.02)),
    "B",
    x=2,
    series="S",
    paper="+1.0",
  )
  exp = Experiment(
    "t:sweep",
    "a sweep",
    (a, b),
    seeds=(0, 1, 2),
    kind="sweep",
    round=3,
    x_label="x",
    pairs=(("b", "a"),),
  )
  acc_a = {0: [0.5, 0.6, 0.70], 1: [0.5, 0.6, 0.72], 2: [0.5, 0.6, 0.69]}
  acc_b = {0: [0.5, 0.6, 0.74], 1: [0.5, 0.6, 0.73], 2: [0.5, 0.6, 0.745]}
  for s in (0, 1, 2):
    _fake_run(tmp_path / "runs", f"a_s{s}", a, s, acc_a[s], [x - 0.1 for x in acc_a[s]])
    _fake_run(tmp_path / "runs", f"b_s{s}", b, s, acc_b[s])
  groups, missing = render.collect(exp, render.dirs_of(str(tmp_path / "runs")))
  assert missing == []
  drawn = render._plot_sweep(exp, groups, str(tmp_path / "sweep"))
  final_a = 100 * np.array([acc_a[s][-1] for s in (0, 1, 2)])
  final_b = 100 * np.array([acc_b[s][-1] for s in (0, 1, 2)])
  t975 = scipy_stats.t.ppf(0.975, 2)
  np.testing.assert_allclose(drawn["S"]["aggregated"], [final_a.mean(), final_b.mean()])
  np.testing.assert_allclose(
    drawn["S"]["aggregated_half"],
    [t975 * scipy_stats.sem(final_a), t975 * scipy_stats.sem(final_b)],
  )
  np.testing.assert_allclose(drawn["S"]["client"][0], final_a.mean() - 10)
  assert np.isnan(drawn["S"]["client"][1])  # B logged no client accuracy
  paired = Experiment(
    "t:paired", "paired", (a, b), seeds=(0, 1, 2), kind="paired", round=3, pairs=(("b", "a"),)
  )
  text = render.render(paired, render.dirs_of(str(tmp_path / "runs")), str(tmp_path / "p"))[
    "markdown"
  ]
  reference = scipy_stats.ttest_rel(final_b, final_a)
  diff = final_b - final_a
  half = t975 * diff.std(ddof=1) / np.sqrt(3)
  assert (
    f"| B − A | 0, 1, 2 | 3 | 74.00, 73.00, 74.50 | 70.00, 72.00, 69.00 | {diff.mean():+.2f} | "
    f"[{diff.mean() - half:.2f}, {diff.mean() + half:.2f}] | {reference.pvalue:.2g} | "
    f"{diff.mean() / diff.std(ddof=1):.2f} | +1.0 |"
  ) in text


def test_rounds_table_reports_seeds_that_did_not_reach_the_target(tmp_path):
  a = Variant("a", "ntk_dfl:smoke", (("rounds", 3),), "A", paper="2")
  exp = Experiment("t:rounds", "rounds", (a,), seeds=(0, 1), kind="rounds")
  _fake_run(tmp_path, "a_s0", a, 0, [0.80, 0.86, 0.87])
  _fake_run(tmp_path, "a_s1", a, 1, [0.80, 0.84, 0.84])
  text = render.render(exp, render.dirs_of(str(tmp_path)), str(tmp_path / "r"))["markdown"]
  assert "| A | 0, 1 | 2, — (3) | 1 of 2 reached | 2 |" in text


def test_the_command_line_runs_a_real_queue_then_renders(tmp_path):
  out = tmp_path / "runs"
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  command = [
    sys.executable,
    "-m",
    "ntk_fl",
    "reproduce",
    "smoke:queue",
    "--out",
    str(out),
    "--variants",
    "smoke_lr01",
  ]
  done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  assert rundir.read_summary(str(out / "smoke_lr01_s0"))["rounds_run"] == 2
  assert "| lr 0.01 | 0 | 2 |" in done.stdout and "smoke_lr03_s0: not run" in done.stdout
  assert (out / "results" / "smoke_queue.md").exists() and (
    out / "results" / "smoke_queue_curves.pdf"
  ).exists()
  again = subprocess.run(
    command + ["--dry_run"], capture_output=True, text=True, env=env, check=False
  )
  assert again.returncode == 0 and again.stdout.startswith("skip: ")
  listing = subprocess.run(
    [sys.executable, "-m", "ntk_fl", "reproduce", "--list"],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert listing.returncode == 0 and "| spark:table3 |" in listing.stdout
  bad = subprocess.run(
    [sys.executable, "-m", "ntk_fl", "reproduce", "spark:fig13"],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert bad.returncode == 2 and "needs data: CIFAR-10" in bad.stderr


def test_a_cpu_queue_leaves_out_the_gpu_variants(tmp_path):
  fig3 = EXPERIMENTS["ntk_dfl:fig3_sparsity"]
  names = {j.variant.name for j in queue.plan(fig3, str(tmp_path), skip_gpu=True)}
  assert names == {f"fig9_ntk_dfl_k{k}" for k in (2, 3, 4, 5, 6)} | {
    f"fig3_dfedavg_k{k}" for k in (2, 3, 4, 5, 6)
  }


def _render_and_archive(name, dirs, tmp_path, capsys):
  """``(exit status, stdout)`` of ``ntk-fl reproduce NAME --runs DIRS`` archiving to
  ``tmp_path/archive``."""
  status = reproduce.main(
    [
      name,
      "--runs",
      *dirs,
      "--render_dir",
      str(tmp_path / "r"),
      "--archive",
      str(tmp_path / "archive"),
    ]
  )
  return status, capsys.readouterr().out


def test_table3_renders_from_named_run_folders_and_archives_them(tmp_path, capsys):
  table3 = EXPERIMENTS["spark:table3"]
  spark = {0: 86.84, 1: 86.34, 2: 86.71}
  ntk = {0: 85.52, 1: 85.45, 2: 85.38}
  dirs = []
  for s in (0, 1, 2):
    dirs.append(
      _fake_run(tmp_path / "a", f"x{s}", table3.variant("spark_alpha0.1"), s, [spark[s] / 100] * 30)
    )
    dirs.append(
      _fake_run(
        tmp_path / "b", f"y{s}", table3.variant("spark_abl_none_alpha0.1"), s, [ntk[s] / 100] * 30
      )
    )
  status, text = _render_and_archive("spark:table3", dirs, tmp_path, capsys)
  assert status == 0
  diff = np.array([spark[s] - ntk[s] for s in (0, 1, 2)])
  p = scipy_stats.ttest_rel([spark[s] for s in (0, 1, 2)], [ntk[s] for s in (0, 1, 2)]).pvalue
  assert (
    "| SPARK, α = 0.1 − NTK-DFL (SPARK's abl_none), α = 0.1 | 0, 1, 2 | 30 | 86.84, 86.34, 86.71 "
    "| "
    f"85.52, 85.45, 85.38 | {diff.mean():+.2f} |"
  ) in text
  assert (
    f"| {p:.2g} | {diff.mean() / diff.std(ddof=1):.2f} | +1.36 [1.24, 1.49] p < 0.001 d_z = 27.09 |"
    in text
  )
  assert (
    "| SPARK, IID − NTK-DFL (SPARK's abl_none), IID | — |" in text
  )  # not run: listed, no numbers
  assert sorted(os.listdir(tmp_path / "archive")) == ["x0", "x1", "x2", "y0", "y1", "y2"]
  assert "archived 6 finished run(s)" in text
  assert reproduce.main(["nope:fig1"]) == 2


def test_archive_leaves_out_unfinished_runs(tmp_path, capsys):
  """An archived copy of a running run would read as its result; it is named and not copied."""
  table3 = EXPERIMENTS["spark:table3"]
  done = _fake_run(tmp_path, "done", table3.variant("spark_alpha0.3"), 0, [0.86] * 30)
  going = _fake_run(tmp_path, "going", table3.variant("spark_abl_none_alpha0.3"), 0, [0.85] * 12)
  status, text = _render_and_archive("spark:table3", [done, going], tmp_path, capsys)
  assert status == 0
  assert os.listdir(tmp_path / "archive") == ["done"]
  assert "archived 1 finished run(s)" in text and "not archived (unfinished): going" in text
  assert f"- going: unfinished, round 12 of 30 ({going})" in text


def test_a_last_round_sweep_draws_only_groups_whose_runs_all_finished(tmp_path):
  a = Variant("a", "ntk_dfl:smoke", (("rounds", 3),), "A", x=1, series="S")
  b = Variant("b", "ntk_dfl:smoke", (("rounds", 3), ("algorithm.lr", 0.02)), "B", x=2, series="S")
  exp = Experiment("t:last", "last", (a, b), seeds=(0, 1), kind="sweep", round=None)
  for s in (0, 1):
    _fake_run(tmp_path / "runs", f"a_s{s}", a, s, [0.5, 0.6, 0.7])
  _fake_run(tmp_path / "runs", "b_s0", b, 0, [0.5, 0.6, 0.8])
  _fake_run(tmp_path / "runs", "b_s1", b, 1, [0.5, 0.65])  # still going
  groups, _ = render.collect(exp, render.dirs_of(str(tmp_path / "runs")))
  drawn = render._plot_sweep(exp, groups, str(tmp_path / "sweep"))
  assert drawn["S"]["x"] == [1]
  np.testing.assert_allclose(drawn["S"]["aggregated"], [70.0])
  assert drawn["S"]["left_off"] == [("B", 2)]
  assert render.unfinished(groups) == [
    f"b_s1: unfinished, round 2 of 3 ({tmp_path / 'runs' / 'b_s1'})"
  ]


def test_the_former_suites_map_onto_experiments(tmp_path):
  env = {
    **os.environ,
    "PYTHONPATH": os.getcwd(),
    "PYTHON": sys.executable,
    "DRY_RUN": "1",
    "ARCHIVE": "",
    "EXTRA": "--config.chunk_size=0",
    "ROWS": "none momentum",
  }
  done = subprocess.run(
    ["bash", "scripts/reproduce.sh", "spark_ablation", str(tmp_path), "0"],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert done.returncode == 0, done.stderr
  lines = done.stdout.splitlines()
  assert [line.split(" ")[0] for line in lines] == ["start:", "start:"]
  assert "--config=spark:iid,abl_none" in lines[0] and "--config.chunk_size=0" in lines[0]
  assert (
    "--config=spark:iid,abl_momentum" in lines[1]
    and f"--workdir={tmp_path}/spark_abl_momentum_iid_s0" in lines[1]
  )
  env["ROWS"] = "nothing"
  bad = subprocess.run(
    ["bash", "scripts/reproduce.sh", "spark_ablation", str(tmp_path)],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert bad.returncode == 2 and "unknown row 'nothing'" in bad.stderr


# ----------------------------------------------------------------------------- progress (--status)


def test_status_reports_each_run_and_the_time_it_still_needs(tmp_path, capsys):
  """A finished run, a partial one (its newest finalised checkpoint, not an unfinished save, is where a
  resume starts; its time left is the rounds left times the median of its own rounds) and runs not
  started (the cost estimate: the CPU's, or the H100's for a variant registered for a GPU)."""
  from ntk_fl.reproduce import progress  # pylint: disable=import-outside-toplevel

  fig16 = EXPERIMENTS["ntk_dfl:fig16"]
  runs = tmp_path / "runs"
  finished = _fake_run(runs, "fig3_dfedavg_k5_s0", fig16.variant("fig3_dfedavg_k5"), 0, [0.8] * 100)
  with open(os.path.join(finished, rundir.SUMMARY_FILE), "w") as f:
    json.dump({"status": "finished"}, f)
  partial = _fake_run(
    runs,
    "by_hand",
    fig16.variant("fig16_compressed_clustered"),
    0,
    [0.6, 0.7, 0.72, 0.75, 0.76, 0.77, 0.78],
  )
  step = [600.0, 100.0, 110.0, 90.0, 105.0, 95.0, 120.0]  # the first round compiles
  lines = rundir.read_metrics(partial)
  for line, seconds in zip(lines, step):
    line.update(step_time=seconds, eval_time=5.0)
  rundir.write_metrics(partial, lines)
  for name in ("4", "6", "7.orbax-checkpoint-tmp-1795800000"):  # round 7's save did not finish
    os.makedirs(os.path.join(rundir.checkpoint_dir(partial), name))

  by_name = {p.name: p for p in progress.experiment_progress(fig16, str(runs))}
  assert sorted(by_name) == [
    "by_hand",
    "fig12_dfedavg_q8_s0",
    "fig3_dfedavg_k5_s0",
    "fig9_ntk_dfl_k5_s0",
  ]
  done = by_name["fig3_dfedavg_k5_s0"]
  assert (done.state, done.held, done.left_seconds, done.accuracy) == ("finished", 100, 0.0, 0.8)
  part = by_name["by_hand"]
  assert (part.state, part.held, part.rounds, part.accuracy) == ("partial", 6, 30, 0.78)
  assert part.round_seconds == 110.0  # the median of 605, 105, 115, 95, 110, 100, 125
  assert part.left_seconds == pytest.approx(24 * 110.0) and part.measured
  for name in ("fig9_ntk_dfl_k5", "fig12_dfedavg_q8"):
    fresh = by_name[f"{name}_s0"]
    cpu, gpu, _ = costs.estimate(stored_form(build_config(fig16.variant(name), 0)))
    assert fresh.state == "not started" and not fresh.measured
    assert fresh.left_seconds == pytest.approx(gpu if fresh.gpu else cpu)

  # A run that ended on a non-finite round is reported as such.
  with open(os.path.join(finished, rundir.SUMMARY_FILE), "w") as f:
    json.dump({"status": "diverged"}, f)
  states = {p.name: p.state for p in progress.experiment_progress(fig16, str(runs))}
  assert states["fig3_dfedavg_k5_s0"] == "diverged"
  with open(os.path.join(finished, rundir.SUMMARY_FILE), "w") as f:
    json.dump({"status": "finished"}, f)
  assert reproduce.main(["ntk_dfl:fig16", "--out", str(runs), "--status"]) == 0
  table = capsys.readouterr().out
  assert "| by_hand | partial | 6 / 30 | 78.00 | 110 | 44 min at its own pace |" in table
  assert "| fig3_dfedavg_k5_s0 | finished | 100 / 100 | 80.00 |" in table
  assert reproduce.main(["--out", str(runs), "--status"]) == 0
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ntk_dfl:fig16 |")]
  assert rows == [rows[0]] and "| 1 | 1 (by_hand 6/30) | 2 | 44 min |" in rows[0]
  # A mistyped folder is an error, not a table of runs "not started".
  assert reproduce.main(["ntk_dfl:fig16", "--out", str(tmp_path / "runz"), "--status"]) == 2
  assert "runz' is not a folder of runs" in capsys.readouterr().err


def test_your_own_method_queues_and_reports_without_a_cost_row(tmp_path):
  """An experiment of a method the cost table does not know (the toy method) still plans, with its
  config's checkpoint cadence, and --status says it has no estimate instead of failing."""
  from ntk_fl.reproduce import progress  # pylint: disable=import-outside-toplevel

  toy = os.path.join(os.path.dirname(__file__), "configs", "toy.py")
  variant = Variant("toy", f"{toy}:smoke", (("rounds", 3),), "toy")
  experiment = Experiment("t:toy", "toy", (variant,), claim="", kind="accuracy")
  assert build_config(variant, 0).method not in costs.ROUND_SECONDS
  [job] = queue.plan(experiment, str(tmp_path))
  assert not any("checkpoint_every" in c for c in job.command)
  [run] = progress.experiment_progress(experiment, str(tmp_path))
  assert (run.state, run.left_seconds) == ("not started", None)
  assert "no estimate" in progress.run_table([run])
