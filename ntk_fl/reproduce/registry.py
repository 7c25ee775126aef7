"""The papers' tables and figures as named experiments: their runs, their result and the paper's
numbers.

An :class:`Experiment` (``ntk_dfl:fig9``) holds :class:`Variant` s -- a packaged
config with its variant string and dotted overrides (rounds and the stopping rule
included) -- the seeds, how the result is computed from the runs (``kind``, see
:mod:`ntk_fl.reproduce.render`), the paper's reported numbers per variant, and
``needs``: what is missing before it can run (data absent from this machine, a
method the library does not have), empty when it runs today.

A run of a variant for seed ``s`` lives in ``OUT/<variant name>_s<s>``; the
renderer finds runs by their stored config, not their name, so a run shared by
two experiments (NTK-DFL's default setting is Fig. 8's regular graph, Fig. 9's
κ = 5, Fig. 11's dynamic topology, ...) is made once and found by both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Experiment", "Script", "Variant", "build_config", "override_flags"]


@dataclasses.dataclass(frozen=True)
class Variant:
  """One curve, bar or row of an experiment.

  Attributes:
    name: the run's name; its seed-``s`` run is ``OUT/<name>_s<s>``. config: a packaged config with
    its variant string (``"ntk_dfl:alpha0.5"``). overrides: dotted config fields set after the
    config is built (``(("topology.degree", 2),)``). label: the legend / table label. x: the
    figure's axis value of a sweep (κ, α, ...). series: the line a sweep point belongs to (usually
    the method). seeds: seeds of this variant when not the experiment's (e.g. the first seed only).
    branch_from: another variant of the experiment whose checkpoint this run starts from (rounds the
    method
      certifies they share, :func:`ntk_fl.rundir.check_branch`).
    gpu: registered for a GPU (too slow for the CPU queue).
    paper: the paper's number for this variant (rounds to target, accuracy, gain ...), as printed.
  """

  name: str
  config: str
  overrides: tuple[tuple[str, Any], ...] = ()
  label: str = ""
  x: Any = None
  series: str = ""
  seeds: tuple[int, ...] | None = None
  branch_from: str = ""
  gpu: bool = False
  paper: str = ""

  @property
  def display(self) -> str:
    return self.label or self.name


@dataclasses.dataclass(frozen=True)
class Script:
  """The script of the source tree that makes an experiment with no training runs
  (:mod:`ntk_fl.reproduce.scripted`).

  Attributes:
    path: the script, relative to the repository root (``"experiments/privacy_attack.py"``).
    args: its arguments; ``{out}`` stands for the folder it writes into.
    outputs: the files it writes there, all of them when it succeeds; a ``.md`` among them is its
      table, put into the rendered page, and ``.png`` / ``.pdf`` files are its figures.
    cpu_minutes: its measured wall time on the 2-core CPU (``ntk-fl reproduce --list``).
  """

  path: str
  args: tuple[str, ...]
  outputs: tuple[str, ...]
  cpu_minutes: float


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A table or figure of a paper.

  Attributes:
    name: ``"<paper>:<table or figure>"``, e.g. ``"ntk_dfl:fig9"``. title: what the paper shows,
    with its table or figure number. claim: the paper's statement the result is checked against.
    variants: the runs (each for every seed in ``seeds`` unless it names its own). seeds: the seeds
    of every variant. kind: how the result is computed: ``"rounds"`` (rounds to ``target``),
    ``"accuracy"`` (aggregated and
      mean-client accuracy at ``round``, their gap), ``"sweep"`` (the same against each variant's
      ``x``), ``"paired"`` (paired t-tests of ``pairs``), ``"communication"`` (accuracy against
      cumulative bits), ``"selection"`` (final-averaging selection curves).
    target: the accuracy target of ``"rounds"``. round: the round of ``"accuracy"``, ``"sweep"`` and
    ``"paired"`` (``None``: the last round every run logged). x_label: the axis of a sweep. pairs:
    ``(method variant, baseline variant)`` names of a ``"paired"`` experiment. needs: what is
    missing before it can run; empty when it runs today. notes: choices made where the paper is
    silent (rounds, grids). script: the script that makes an experiment with no runs (an attack, a
    toy regression), run by ``ntk-fl reproduce`` like a queue of one.
  """

  name: str
  title: str
  variants: tuple[Variant, ...]
  claim: str = ""
  seeds: tuple[int, ...] = (0,)
  kind: str = "accuracy"
  target: float = 0.85
  round: int | None = None
  x_label: str = ""
  pairs: tuple[tuple[str, str], ...] = ()
  needs: str = ""
  notes: str = ""
  script: Script | None = None

  def seeds_of(self, variant: Variant, seeds: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The seeds ``variant`` runs for (``seeds`` replaces the experiment's, as ``--seeds`` does)."""
    if variant.seeds is not None:
      chosen = seeds if seeds is not None else self.seeds
      return tuple(s for s in variant.seeds if s in chosen) if seeds is not None else variant.seeds
    return tuple(seeds if seeds is not None else self.seeds)

  def variant(self, name: str) -> Variant:
    for v in self.variants:
      if v.name == name:
        return v
    raise KeyError(
      f"{self.name} has no variant {name!r}; its variants: {[v.name for v in self.variants]}"
    )


def build_config(variant: Variant, seed: int):
  """The ``ml_collections.ConfigDict`` of ``variant``'s run for ``seed`` (what its command line
  builds).

  Raises:
    ValueError: an override names no field of the config.
  """
  from ntk_fl.config import load_config  # pylint: disable=import-outside-toplevel

  file_part, _, variant_string = variant.config.partition(":")
  config = load_config(file_part, variant_string or None)
  config.seed = seed
  for key, value in variant.overrides:
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      if part not in node:
        raise ValueError(
          f"variant {variant.name}: override {key}: config {variant.config} has no field "
          f"{'.'.join(parents)}"
        )
      node = node[part]
    if leaf not in node:
      raise ValueError(
        f"variant {variant.name}: override {key}: config {variant.config} has no field {key}"
      )
    node[leaf] = value
  return config


def config_flags(pairs) -> list[str]:
  """``--config.<key>=<value>`` flags of ``(dotted key, value)`` pairs, as ``ntk-fl`` parses them back."""

  def text(value) -> str:
    if isinstance(value, tuple):
      inner = ",".join(text(v) for v in value)
      return f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value) if isinstance(value, float) else str(value)

  return [f"--config.{key}={text(value)}" for key, value in pairs]


def override_flags(variant: Variant) -> list[str]:
  """``--config.<key>=<value>`` flags of the variant's overrides, as ``ntk-fl`` parses them back."""
  return config_flags(variant.overrides)
