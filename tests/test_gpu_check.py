"""benchmarks/gpu_check.py keeps working without an accelerator: its ``--quick`` table on the CPU."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_table_has_every_case(tmp_path):
  out = tmp_path / "rows.json"
  done = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "benchmarks", "gpu_check.py"),
      "--quick",
      "--repeats",
      "1",
      "--cases",
      "ntk_dfl,kernel,dfedavg,spark,ntk_dfl_cnn,replicas_dfedavg",
      "--json",
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  report = json.loads(out.read_text())
  rows = report["rows"]
  assert [row["case"] for row in rows] == [
    "ntk_dfl round",
    "structured NTK",
    "dfedavg round",
    "spark round",
    "ntk_dfl round",
    "dfedavg seed-batched round",
  ]
  for row in rows:
    assert "error" not in row, row
    assert 0 < row["steady_s"] <= row["first_s"] + 60, (
      row
    )  # the first call compiles; steady ones do not
    assert row["peak_bytes"] > 0
  assert "chunk 5" in rows[0]["setting"]
  assert "model cnn" in rows[4]["setting"]
  assert "S = 2 replicas" in rows[5]["setting"]
  assert "| case | setting |" in done.stdout
