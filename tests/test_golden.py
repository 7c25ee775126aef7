"""Golden smoke runs: every method's smoke run (and the variants that take the NTK step's other branches)
still gives the recorded per-round metrics (tests/golden/*.json, written by tests/golden_runs.py).

What must agree, and how closely:

* ``round``, ``bits_cumulative`` (communication accounting is integer arithmetic held exactly in float32)
  and every client's chosen ``τ`` (a discrete choice: a changed τ is a changed result, not rounding) --
  exactly.
* Accuracies, losses and ``lr`` -- to float32 rounding, amplified by the run. A refactor may reorder a
  float32 reduction (e.g. a kernel contraction summed in another leaf order), which moves a value by a few
  units in the last place (eps = 1.2e-7). Inside a round that error is carried through up to τ_max = 200
  Euler steps of ``f ← f − (η/N) K r`` (a stable, non-expanding map at these step sizes: the error grows at
  most linearly, ≲ 200 · few eps ≈ 1e-5) and then through the 2-4 rounds of the smoke run, each starting
  from the last one's weights. ``RTOL = 1e-4`` covers that with margin and is still three orders of
  magnitude below any real change (a changed τ, target or kernel moves losses by > 1e-2 relative).
  Test accuracy counts correct predictions out of 2,000; a rounding-level change can flip a sample whose
  two top logits tie to within rounding, so accuracies may differ by at most ``ACC_ATOL`` = 2 samples.

Runs with 6- or 8-bit quantisation of the Jacobians (SPARK's and NTK-DFL's compression stacks, CP-NTK-FL's
``table1``) are
discontinuous in their inputs: a rounding-level change of a weight can move one Jacobian entry across a
quantisation level, i.e. by one step (its package's range / 63), which moves that client's selected loss by
~1e-4 relative (measured: 2e-4 at most, on one client of twenty, in rounds 3-4). For them the loss tolerance
is ``QUANTIZED_RTOL = 1e-3``; τ, bits and accuracies keep their checks.

Where the computation order is unchanged the values are bit-identical (the runs are deterministic on one
machine); the tolerances only admit reordered float32 arithmetic.

Another kind of CPU is another computation order: XLA's CPU backend generates code for the instruction set
it finds (AVX2 or AVX-512) and blocks matrix products for the caches. Most runs still agree within the
tolerances above; a few carry the difference further (measured on an AVX2-only AMD EPYC against the main
records: NTK-DFL ``batched,subsample`` one client's loss 2.3e-2 relative and the mean loss 9.4e-4, NTK-DFL
``mse`` 1.3e-3, SPARK 1.0e-4 and 1.1e-4, with every τ, bit count and accuracy as recorded). Widening the
tolerances to that would hide real changes, so such a run keeps a record per CPU kind
(``tests/golden/<kind>/``, see tests/golden_runs.py) and passes when it matches any of them.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import golden_runs

RTOL = 1e-4
QUANTIZED_RTOL = 1e-3
QUANTIZED_RUNS = (
  "spark:smoke,proj500,compressed",
  "cp_ntk_fl:smoke,table1",
  "cp_ntk_fl:smoke,table1,shuffle",
  "ntk_dfl:smoke,topk0.5,bits6,subsample,proj20,clustered",
  "spark:smoke,option_b,compressed",
)
ACC_ATOL = 2 / 2_000
EXACT = ("round", "bits_cumulative", "clients_tau")
ACCURACIES = ("test_acc", "client_acc_mean", "consensus_acc_mean")


def compare(name: str, expected: dict, actual: dict) -> None:
  """Asserts that run ``name``'s record ``actual`` matches ``expected`` within the tolerances above."""
  assert [r["round"] for r in actual["rounds"]] == [r["round"] for r in expected["rounds"]], name
  for want, got in zip(expected["rounds"], actual["rounds"]):
    where = f"{name}, round {want['round']}"
    assert sorted(got) == sorted(want), (
      f"{where}: recorded fields {sorted(want)}, now {sorted(got)}"
    )
    for key, value in want.items():
      if key in EXACT:
        np.testing.assert_array_equal(got[key], value, err_msg=f"{where}: {key}")
      elif key in ACCURACIES:
        np.testing.assert_allclose(
          got[key], value, rtol=0, atol=ACC_ATOL, err_msg=f"{where}: {key}"
        )
      else:
        rtol = QUANTIZED_RTOL if name in QUANTIZED_RUNS else RTOL
        np.testing.assert_allclose(got[key], value, rtol=rtol, atol=0, err_msg=f"{where}: {key}")


def test_every_config_has_a_golden_file():
  recorded = sorted(p.name for p in golden_runs.GOLDEN_DIR.glob("*.json"))
  expected = sorted(
    golden_runs.path(name, variant).name for name, variant in golden_runs.golden_runs()
  )
  assert recorded == expected
  # A CPU kind's folder says which CPU made it and holds records of known runs only.
  for folder in (p for p in golden_runs.GOLDEN_DIR.iterdir() if p.is_dir()):
    platform = json.loads((folder / "PLATFORM.json").read_text())
    assert platform["model name"] and platform["vector flags"], folder
    extra = {p.name for p in folder.glob("*.json")} - {"PLATFORM.json"}
    assert extra and extra <= set(expected), (folder, extra - set(expected))


def test_compare_admits_rounding_and_refuses_a_moved_value_or_tau():
  recorded = json.loads(golden_runs.path("ntk_dfl").read_text())
  compare("ntk_dfl:smoke", recorded, recorded)
  rounded = copy.deepcopy(recorded)
  rounded["rounds"][-1]["test_loss"] *= 1 + RTOL / 10
  compare("ntk_dfl:smoke", recorded, rounded)
  moved = copy.deepcopy(recorded)
  moved["rounds"][-1]["test_loss"] *= 1 + 10 * RTOL
  with pytest.raises(AssertionError, match="test_loss"):
    compare("ntk_dfl:smoke", recorded, moved)
  retimed = copy.deepcopy(recorded)
  retimed["rounds"][0]["clients_tau"][0] += 100
  with pytest.raises(AssertionError, match="clients_tau"):
    compare("ntk_dfl:smoke", recorded, retimed)


# Runs that take minutes on a 2-core CPU (SPARK's compression stack builds every client's explicit
# compressed Jacobian; the CNN runs compile the CNN's steps, cost estimates and evaluation, 1-2 minutes
# each): opt-in, marked slow (CI runs them with ``-m slow``; README, "Tests").
SLOW_RUNS = (
  "spark:smoke,proj500,compressed",
  "spark:smoke,option_b,compressed",
  "ntk_fl:smoke,cnn,few,two_per_round",
  "cp_ntk_fl:smoke,cnn,few,two_per_round",
  "spark:smoke,cnn,few,one_round",
  "fed_ensemble:smoke,cnn,few,two_per_round,shards5",
)


@pytest.mark.parametrize(
  "name,variant",
  [
    pytest.param(n, v, marks=[pytest.mark.slow] if f"{n}:{v}" in SLOW_RUNS else [])
    for n, v in golden_runs.golden_runs()
  ],
  ids=[golden_runs.path(n, v).stem for n, v in golden_runs.golden_runs()],
)
def test_smoke_run_matches_golden(name, variant):
  actual = golden_runs.record(name, variant)
  mismatches = []
  for recorded in golden_runs.records(name, variant).values():
    try:
      compare(f"{name}:{variant}", json.loads(recorded.read_text()), actual)
      return  # matches the record of one CPU kind
    except AssertionError as error:
      mismatches.append(f"against {recorded.relative_to(golden_runs.REPO)}: {error}")
  raise AssertionError("\n".join(mismatches))
