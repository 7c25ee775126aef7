"""TensorBoard event files of a run, written beside ``metrics.jsonl`` (tensorboardX: no TensorFlow needed).

Every metrics line becomes scalars at ``step = round`` under a few groups, so
``tensorboard --logdir runs/`` compares runs side by side:

==================  ==========================================================
``accuracy/``       ``aggregated`` (the aggregated model), ``client_mean|min|max``
                    (each client's own model), ``consensus_mean|min|max``
``loss/``           test cross-entropy: ``aggregated``, ``client_mean``, ``consensus_mean``
``train_loss/``     the method's own per-client training loss: ``mean|min|max``
``deviation/``      ``inter_client``: NTK-DFL eq. 12
``tau/``            the chosen evolution time per client: ``mean|min|max``, and per
                    value ``clients_at_<tau>`` (how many clients chose it)
``communication/``  ``bits_sent_mean|min|max`` per client, ``bits_sent_total`` in the
                    round, ``bits_cumulative`` since round 1
``time/``           ``step_s``, ``eval_s``: seconds of the round's step and evaluation
``algorithm/``      every other scalar the method reports (``lr``, ...)
==================  ==========================================================

and each per-client array of the line (``clients``: test accuracy, τ, loss,
bits) a histogram under ``clients/``. The run's config is written once per
writer (:meth:`EventWriter.write_config`): every field as a hyperparameter of
TensorBoard's HParams tab (which tabulates and filters runs by them) and the
whole config as JSON under the ``config`` text tag.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["EventWriter", "hparams_of", "round_scalars"]

_GROUPS = (  # metric-name prefix -> (tag group, tag name after the prefix is removed)
  ("test_acc", "accuracy/aggregated"),
  ("client_acc_", "accuracy/client_"),
  ("consensus_acc_", "accuracy/consensus_"),
  ("test_loss", "loss/aggregated"),
  ("client_loss_", "loss/client_"),
  ("consensus_loss_", "loss/consensus_"),
  ("loss_", "train_loss/"),
  ("deviation", "deviation/inter_client"),
  ("tau_", "tau/"),
  ("bits_", "communication/bits_"),
  ("step_time", "time/step_s"),
  ("eval_time", "time/eval_s"),
)


def _tag(name: str) -> str:
  for prefix, tag in _GROUPS:
    if name == prefix or (prefix.endswith("_") and name.startswith(prefix)):
      return tag + name[len(prefix) :] if prefix.endswith("_") else tag
  return f"algorithm/{name}"


def round_scalars(line: Mapping) -> dict[str, float]:
  """The TensorBoard scalars of one metrics line: ``{tag: value}`` (finite numbers only).

  ``line`` is what the runner writes to ``metrics.jsonl``; ``round`` is the step,
  not a scalar, and ``None``/NaN entries (rounds that were not evaluated) are left out.
  """
  scalars = {}
  for name, value in line.items():
    if (
      name in ("round", "clients") or isinstance(value, bool) or not isinstance(value, (int, float))
    ):
      continue
    if math.isfinite(value):
      scalars[_tag(name)] = float(value)
  taus = (line.get("clients") or {}).get("tau")
  if taus is not None:
    for tau, count in sorted(collections.Counter(np.asarray(taus).ravel().tolist()).items()):
      scalars[f"tau/clients_at_{tau:g}"] = float(count)
  return scalars


_TENSORBOARD_BUCKET_END = 1e20
_HPARAM_METRICS = (
  "accuracy/aggregated",
  "accuracy/client_mean",
  "loss/aggregated",
  "communication/bits_cumulative",
)


def hparams_of(config: Mapping, prefix: str = "") -> dict[str, bool | int | float | str]:
  """The config's fields as TensorBoard hyperparameters: ``{'data.alpha': 0.1, ...}``.

  ``config`` is the config's JSON form (``config.json``); nested blocks become
  dotted names, lists and ``None`` their JSON text (HParams holds bool, number
  or string values only).
  """
  out = {}
  for key, value in config.items():
    if isinstance(value, Mapping):
      out.update(hparams_of(value, f"{prefix}{key}."))
    elif isinstance(value, (bool, int, float, str)):
      out[f"{prefix}{key}"] = value
    else:
      out[f"{prefix}{key}"] = json.dumps(value)
  return out


class EventWriter:
  """Appends a run's rounds to TensorBoard event files in ``workdir``.

  Args:
    workdir: the run directory (event files ``events.out.tfevents.*`` go there).
    first_round: the first round this writer will log (1-based). A resumed or
      branched run starts after round ``k``; TensorBoard then discards the events
      of rounds ``> k`` that an earlier, interrupted writer left (``purge_step``),
      so every round appears once.
  """

  def __init__(self, workdir: str | os.PathLike, *, first_round: int = 1):
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

    # The file name holds the time in seconds; the first round keeps a resumed run's file (same second,
    # e.g. in tests) from replacing the interrupted one's.
    self._writer = SummaryWriter(
      logdir=os.fspath(workdir),
      purge_step=first_round if first_round > 1 else None,
      flush_secs=30,
      filename_suffix=f".from_round_{first_round}",
    )

  def write(self, line: Mapping) -> None:
    """One metrics line (``round`` is the step)."""
    step = int(line["round"])
    for tag, value in round_scalars(line).items():
      self._writer.add_scalar(tag, value, step)
    for name, values in (line.get("clients") or {}).items():
      values = np.asarray(values, dtype=np.float64).ravel()
      values = values[np.isfinite(values)]
      if values.size:
        # TensorBoard's buckets end at 1e20: a run on its way to diverging (losses of 1e26) gets numpy's bins.
        bins = "tensorflow" if np.abs(values).max() < _TENSORBOARD_BUCKET_END else "auto"
        self._writer.add_histogram(f"clients/{name}", values, step, bins=bins)
    self._writer.flush()

  def write_config(self, config: Mapping) -> None:
    """The run's config (its JSON form): HParams hyperparameters and a ``config`` text entry."""
    from tensorboardX.summary import hparams  # pylint: disable=import-outside-toplevel

    # The HParams summaries go into this run's own event file (SummaryWriter.add_hparams would
    # open a sub-run), so the HParams tab pairs the config with the run's scalars of these tags.
    for summary in hparams(hparams_of(config), {tag: 0.0 for tag in _HPARAM_METRICS}):
      self._writer.file_writer.add_summary(summary)
    self._writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
    self._writer.flush()

  def write_all(self, lines: Iterable[Mapping]) -> None:
    for line in lines:
      self.write(line)

  def close(self) -> None:
    self._writer.close()

  def __enter__(self) -> EventWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
