"""The smoke slice of every NTK method, with the MLP and with the CNN (either token order)."""

from __future__ import annotations

import pytest

from ntk_fl import config as config_lib
from tests.golden_runs import CONFIG_DIR

METHODS = ("ntk_dfl", "ntk_fl", "cp_ntk_fl", "spark", "fed_ensemble")


def _slice(method: str, variant: str) -> tuple:
  config = config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), variant)
  data = config.data
  return data.num_clients, data.samples_per_client, data.max_test, config.eval.batch_size


@pytest.mark.parametrize("method", METHODS)
def test_cnn_smoke_slice_is_smaller_in_either_order_and_the_mlp_slice_is_unchanged(method):
  cnn = (
    config_lib.SMOKE_CNN_CLIENTS,
    config_lib.SMOKE_CNN_SAMPLES,
    config_lib.SMOKE_CNN_TEST,
    config_lib.SMOKE_CNN_TEST,
  )
  assert _slice(method, "smoke,cnn") == cnn
  assert _slice(method, "cnn,smoke") == cnn
  assert _slice(method, "smoke") == (20, 100, 2_000, 2_000)


def test_cnn_without_smoke_keeps_the_full_data():
  full = _slice("ntk_dfl", "")
  assert _slice("ntk_dfl", "cnn") == full


@pytest.mark.parametrize("method", METHODS)
def test_cnn_smoke_runs_clients_one_at_a_time(method):
  for variant in ("smoke,cnn", "cnn,smoke"):
    assert config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), variant).chunk_size == 1
  assert config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), "cnn").chunk_size == (
    config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), "").chunk_size
  )
