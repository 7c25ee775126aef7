"""Plots of a run, each a PNG and a vector PDF: accuracy, losses, communication, client selection.

Figures are built with :class:`matplotlib.figure.Figure` directly (Agg canvas,
no pyplot global state), so plotting works headless and from threads, and each
file is written to a temporary name and renamed, so a reader never sees half a
file. ``plot_*(..., path)`` writes ``path`` (a ``.png``, 200 dpi) and the same
figure as a PDF beside it (``accuracy.png`` -> ``accuracy.pdf``), for papers.
:func:`plot_run` draws every per-run figure from a run's metrics lines.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = [
  "ACCURACY_PLOT",
  "COMMUNICATION_PLOT",
  "LOSS_PLOT",
  "accuracy_figure",
  "communication_figure",
  "loss_figure",
  "plot_accuracy",
  "plot_communication",
  "plot_losses",
  "plot_run",
  "plot_selection_curves",
  "selection_figure",
]

ACCURACY_PLOT = "accuracy.png"
"""Test accuracy vs round (:func:`plot_accuracy`; also ``accuracy.pdf``)."""
LOSS_PLOT = "loss.png"
"""Test and training losses vs round (:func:`plot_losses`; also ``loss.pdf``)."""
COMMUNICATION_PLOT = "communication.png"
"""Aggregated accuracy vs bits sent (:func:`plot_communication`; also ``communication.pdf``), for
methods that report ``bits_cumulative``."""

DPI = 200

_SELECTION_STYLE = {  # NTK-DFL Fig. 6 colours: proposed order red, random green, lower bound blue
  "best_to_worst": ("best to worst (validation half)", "tab:red"),
  "random": ("random", "tab:green"),
  "worst_to_best": ("worst to best", "tab:blue"),
}


def _save(fig: Figure, path: str | os.PathLike) -> None:
  """Writes ``fig`` to ``path`` (PNG) and, as a vector PDF, to ``path`` with the suffix ``.pdf``."""
  path = os.fspath(path)
  FigureCanvasAgg(fig)
  for target, fmt in ((path, "png"), (os.path.splitext(path)[0] + ".pdf", "pdf")):
    tmp = f"{target}.tmp"
    fig.savefig(tmp, format=fmt, dpi=DPI, bbox_inches="tight")
    os.replace(tmp, target)


def _as_float(values: Sequence[float | None]) -> np.ndarray:
  return np.array([np.nan if v is None else v for v in values], dtype=float)


def _label_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
  """Axis labels, integer x ticks, a light grid, the legend below the axes (never over a curve), the title."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.xaxis.set_major_locator(
    MaxNLocator(integer=True)
  )  # rounds and client counts are whole numbers
  ax.grid(alpha=0.3)
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
  if title:
    ax.set_title(title)


def accuracy_figure(
  rounds: Sequence[int],
  aggregated: Sequence[float | None],
  client_mean: Sequence[float | None],
  client_min: Sequence[float | None],
  client_max: Sequence[float | None],
  *,
  title: str = "",
) -> Figure:
  """The figure of :func:`plot_accuracy` (for callers that add to it or save it themselves)."""
  rounds = np.asarray(rounds)
  fig = Figure(figsize=(6, 4.4))
  ax = fig.add_subplot()
  agg = _as_float(aggregated)
  ok = ~np.isnan(agg)
  ax.plot(
    rounds[ok],
    agg[ok],
    "-o",
    ms=3,
    color="tab:blue",
    label="aggregated model (mean of client weights)",
  )
  mean, low, high = _as_float(client_mean), _as_float(client_min), _as_float(client_max)
  ok = ~np.isnan(mean)
  if ok.any():
    ax.plot(rounds[ok], mean[ok], "--", color="tab:orange", label="mean over clients")
    ax.fill_between(
      rounds[ok], low[ok], high[ok], color="tab:orange", alpha=0.2, label="client min to max"
    )
  _label_axes(ax, "communication round", "accuracy on the test set", title)
  return fig


def plot_accuracy(
  rounds: Sequence[int],
  aggregated: Sequence[float | None],
  client_mean: Sequence[float | None],
  client_min: Sequence[float | None],
  client_max: Sequence[float | None],
  path: str | os.PathLike,
  *,
  title: str = "",
) -> None:
  """Test accuracy vs round: aggregated model, mean client and the client min-max band.

  Args:
    rounds: ``[R]`` 1-based round numbers.
    aggregated, client_mean, client_min, client_max: ``[R]`` accuracies; ``None``
      or NaN where a round was not evaluated (those points are skipped).
    path: output PNG (a PDF is written beside it).
    title: optional figure title (e.g. method and config variant).
  """
  _save(accuracy_figure(rounds, aggregated, client_mean, client_min, client_max, title=title), path)


def selection_figure(curves: Mapping[str, Sequence[float]], *, title: str = "") -> Figure:
  """The figure of :func:`plot_selection_curves`."""
  fig = Figure(figsize=(11, 4.4) if "test_accuracy" in curves else (6, 4.4))
  ax = fig.add_subplot(1, 2 if "test_accuracy" in curves else 1, 1)
  for name, (label, color) in _SELECTION_STYLE.items():
    acc = np.asarray(curves[name], dtype=float)
    ax.plot(np.arange(1, acc.size + 1), acc, color=color, label=label)
  _label_axes(
    ax,
    "k clients averaged (ranked on the validation half of the test set)",
    "accuracy of their average on the test half",
    title,
  )
  if "test_accuracy" in curves:
    hist = fig.add_subplot(1, 2, 2)
    hist.hist(np.asarray(curves["test_accuracy"], dtype=float), bins=20, color="tab:gray")
    hist.set_xlabel("one client's own model: accuracy on the test half")
    hist.set_ylabel("number of clients")
    hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist.grid(alpha=0.3, axis="y")
    hist.set_title("client models", fontsize="medium")
  return fig


def plot_selection_curves(
  curves: Mapping[str, Sequence[float]], path: str | os.PathLike, *, title: str = ""
) -> None:
  """Test accuracy of the running average vs number of clients averaged (NTK-DFL Fig. 6).

  Args:
    curves: ``best_to_worst``, ``random``, ``worst_to_best`` -> ``[M]``
      accuracies (as :func:`ntk_fl.metrics.selection_curves` returns); when
      ``test_accuracy`` is present its histogram is drawn on a second axis.
    path: output PNG (a PDF is written beside it).
    title: optional figure title.
  """
  _save(selection_figure(curves, title=title), path)


def _column(lines: Sequence[Mapping], name: str) -> np.ndarray:
  """``[R]`` float values of ``name`` over the metrics lines (NaN where a line lacks it)."""
  return _as_float([line.get(name) for line in lines])


def _plot_present(ax, x: np.ndarray, y: np.ndarray, *args, **kwargs) -> bool:
  ok = ~np.isnan(y)
  if ok.any():
    ax.plot(x[ok], y[ok], *args, **kwargs)
  return bool(ok.any())


def loss_figure(lines: Sequence[Mapping], *, title: str = "") -> Figure | None:
  """The figure of :func:`plot_losses`, or None when the lines hold no loss."""
  rounds = np.asarray([line["round"] for line in lines], dtype=float)
  fig = Figure(figsize=(6, 4.4))
  ax = fig.add_subplot()
  drawn = [
    _plot_present(
      ax,
      rounds,
      _column(lines, "test_loss"),
      "-o",
      ms=3,
      color="tab:blue",
      label="aggregated model: test loss",
    ),
    _plot_present(
      ax,
      rounds,
      _column(lines, "client_loss_mean"),
      "--",
      color="tab:orange",
      label="clients' own models: mean test loss",
    ),
    _plot_present(
      ax,
      rounds,
      _column(lines, "loss_mean"),
      "-",
      color="tab:green",
      label="training loss: mean over clients",
    ),
  ]
  low, high = _column(lines, "loss_min"), _column(lines, "loss_max")
  ok = ~np.isnan(low) & ~np.isnan(high)
  if ok.any():
    ax.fill_between(
      rounds[ok], low[ok], high[ok], color="tab:green", alpha=0.2, label="training loss: min to max"
    )
  if not any(drawn):
    return None
  values = np.concatenate(
    [_column(lines, name) for name in ("test_loss", "client_loss_mean", "loss_mean", "loss_min")]
  )
  if np.nanmin(values) > 0:
    ax.set_yscale("log")  # losses fall by decades over a run
  _label_axes(
    ax, "communication round", "loss (test: cross-entropy; training: the method's own)", title
  )
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
  return fig


def plot_losses(lines: Sequence[Mapping], path: str | os.PathLike, *, title: str = "") -> bool:
  """Test loss (aggregated model, mean client) and the method's training loss vs round.

  Args:
    lines: the run's metrics lines (``round``, ``test_loss``, ``client_loss_mean``,
      ``loss_mean|min|max``; missing or None values are skipped).
    path: output PNG (a PDF is written beside it).
    title: optional figure title.

  Returns:
    Whether a figure was written (False when no line holds a loss).
  """
  fig = loss_figure(lines, title=title)
  if fig is not None:
    _save(fig, path)
  return fig is not None


def communication_figure(lines: Sequence[Mapping], *, title: str = "") -> Figure | None:
  """The figure of :func:`plot_communication`, or None without ``bits_cumulative`` and accuracy."""
  bits, acc = _column(lines, "bits_cumulative"), _column(lines, "test_acc")
  ok = ~np.isnan(bits) & ~np.isnan(acc)
  if not ok.any():
    return None
  fig = Figure(figsize=(6, 4.4))
  ax = fig.add_subplot()
  ax.plot(
    bits[ok],
    acc[ok],
    "-o",
    ms=3,
    color="tab:blue",
    label="aggregated model (mean of client weights)",
  )
  ax.set_xlabel("bits sent since round 1 (all clients)")
  ax.set_ylabel("accuracy on the test set")
  if bits[ok].min() > 0 and bits[ok].max() / bits[ok].min() > 100:
    ax.set_xscale("log")
  ax.grid(alpha=0.3)
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
  if title:
    ax.set_title(title)
  return fig


def plot_communication(
  lines: Sequence[Mapping], path: str | os.PathLike, *, title: str = ""
) -> bool:
  """Aggregated test accuracy vs cumulative bits sent (the NTK papers' communication axis).

  Args:
    lines: the run's metrics lines; a point per line with both ``bits_cumulative``
      (bits sent by all clients since round 1) and ``test_acc``.
    path: output PNG (a PDF is written beside it).
    title: optional figure title.

  Returns:
    Whether a figure was written (False when the method reports no bits).
  """
  fig = communication_figure(lines, title=title)
  if fig is not None:
    _save(fig, path)
  return fig is not None


def plot_run(lines: Sequence[Mapping], workdir: str | os.PathLike, *, title: str = "") -> list[str]:
  """Every per-round figure of a run from its metrics lines, into ``workdir``; returns the PNGs.

  :data:`ACCURACY_PLOT` always; :data:`LOSS_PLOT` when a loss was recorded;
  :data:`COMMUNICATION_PLOT` when the method reports ``bits_cumulative``. Each
  comes with its PDF.
  """
  workdir = os.fspath(workdir)
  column = lambda name: [line.get(name) for line in lines]
  plot_accuracy(
    [line["round"] for line in lines],
    column("test_acc"),
    column("client_acc_mean"),
    column("client_acc_min"),
    column("client_acc_max"),
    os.path.join(workdir, ACCURACY_PLOT),
    title=title,
  )
  written = [ACCURACY_PLOT]
  if plot_losses(lines, os.path.join(workdir, LOSS_PLOT), title=title):
    written.append(LOSS_PLOT)
  if plot_communication(lines, os.path.join(workdir, COMMUNICATION_PLOT), title=title):
    written.append(COMMUNICATION_PLOT)
  return written
