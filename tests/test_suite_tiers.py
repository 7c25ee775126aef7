"""The split of the suite into the default tier and the opt-in ``slow`` tier (tests/slow_tests.txt)."""

import pathlib
import types

import conftest
import pytest

TESTS = pathlib.Path(__file__).parent


def test_the_list_names_existing_files_once_each_with_its_cost():
  lines = [line for line in conftest.SLOW_TESTS.read_text().splitlines() if line and line[0] != "#"]
  ids = conftest._read_slow_list(conftest.SLOW_TESTS)
  assert len(ids) == len(lines) == len(set(ids)) > 0
  for line, node_id in zip(lines, ids, strict=True):
    path, _, name = node_id.partition("::")
    assert (TESTS.parent / path).is_file() and name.startswith("test_"), node_id
    assert float(line.split("\t")[1]) >= 0, line  # the measured CPU seconds


class _Item:
  def __init__(self, node_id):
    self.nodeid = node_id
    self.path = TESTS.parent / node_id.split("::")[0]
    self.markers = []

  def add_marker(self, marker):
    self.markers.append(marker.name)


def _config(*args):
  return types.SimpleNamespace(
    args=list(args), invocation_params=types.SimpleNamespace(dir=TESTS.parent)
  )


def test_listed_tests_are_marked_slow_and_others_are_not():
  items = [_Item("tests/test_rng.py::test_a"), _Item("tests/test_rng.py::test_b[1]")]
  conftest._mark_listed_slow(_config("tests"), items, ["tests/test_rng.py::test_b[1]"])
  assert [item.markers for item in items] == [[], ["slow"]]


@pytest.mark.parametrize("arg", ["tests", "tests/test_rng.py"])
def test_a_listed_test_missing_from_a_wholly_collected_file_is_an_error(arg):
  items = [_Item("tests/test_rng.py::test_a")]
  with pytest.raises(pytest.UsageError, match=r"test_rng\.py::test_renamed"):
    conftest._mark_listed_slow(_config(arg), items, ["tests/test_rng.py::test_renamed"])


@pytest.mark.parametrize("arg", ["tests/test_rng.py::test_a", "tests/test_topology.py"])
def test_a_partial_collection_is_not_checked_for_missing_tests(arg):
  items = [_Item("tests/test_rng.py::test_a")]
  conftest._mark_listed_slow(_config(arg), items, ["tests/test_rng.py::test_renamed"])
  assert items[0].markers == []
