"""PNG plots of a run: accuracy vs round and the final client-selection curves.

Figures are built with :class:`matplotlib.figure.Figure` directly (Agg canvas,
no pyplot global state), so plotting works headless and from threads, and each
file is written to a temporary name and renamed, so a reader never sees half a PNG.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["accuracy_figure", "plot_accuracy", "plot_selection_curves", "selection_figure"]

_SELECTION_STYLE = {  # NTK-DFL Fig. 6 colours: proposed order red, random green, lower bound blue
    "best_to_worst": ("best to worst (validation half)", "tab:red"),
    "random": ("random", "tab:green"),
    "worst_to_best": ("worst to best", "tab:blue"),
}


def _save(fig: Figure, path: str | os.PathLike) -> None:
  path = os.fspath(path)
  tmp = f"{path}.tmp"
  FigureCanvasAgg(fig)
  fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
  os.replace(tmp, path)


def _as_float(values: Sequence[float | None]) -> np.ndarray:
  return np.array([np.nan if v is None else v for v in values], dtype=float)


def _label_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
  """Axis labels, integer x ticks, a light grid, the legend below the axes (never over a curve), the title."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # rounds and client counts are whole numbers
  ax.grid(alpha=0.3)
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
  if title:
    ax.set_title(title)


def accuracy_figure(rounds: Sequence[int], aggregated: Sequence[float | None],
                    client_mean: Sequence[float | None], client_min: Sequence[float | None],
                    client_max: Sequence[float | None], *, title: str = "") -> Figure:
  """The figure of :func:`plot_accuracy` (for callers that add to it or save it themselves)."""
  rounds = np.asarray(rounds)
  fig = Figure(figsize=(6, 4.4))
  ax = fig.add_subplot()
  agg = _as_float(aggregated)
  ok = ~np.isnan(agg)
  ax.plot(rounds[ok], agg[ok], "-o", ms=3, color="tab:blue", label="aggregated model (mean of client weights)")
  mean, low, high = _as_float(client_mean), _as_float(client_min), _as_float(client_max)
  ok = ~np.isnan(mean)
  if ok.any():
    ax.plot(rounds[ok], mean[ok], "--", color="tab:orange", label="mean over clients")
    ax.fill_between(rounds[ok], low[ok], high[ok], color="tab:orange", alpha=0.2, label="client min to max")
  _label_axes(ax, "communication round", "accuracy on the test set", title)
  return fig


def plot_accuracy(rounds: Sequence[int], aggregated: Sequence[float | None],
                  client_mean: Sequence[float | None], client_min: Sequence[float | None],
                  client_max: Sequence[float | None], path: str | os.PathLike, *,
                  title: str = "") -> None:
  """Test accuracy vs round: aggregated model, mean client and the client min-max band.

  Args:
    rounds: ``[R]`` 1-based round numbers.
    aggregated, client_mean, client_min, client_max: ``[R]`` accuracies; ``None``
      or NaN where a round was not evaluated (those points are skipped).
    path: output PNG.
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
  _label_axes(ax, "k clients averaged (ranked on the validation half of the test set)",
              "accuracy of their average on the test half", title)
  if "test_accuracy" in curves:
    hist = fig.add_subplot(1, 2, 2)
    hist.hist(np.asarray(curves["test_accuracy"], dtype=float), bins=20, color="tab:gray")
    hist.set_xlabel("one client's own model: accuracy on the test half")
    hist.set_ylabel("number of clients")
    hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist.grid(alpha=0.3, axis="y")
    hist.set_title("client models", fontsize="medium")
  return fig


def plot_selection_curves(curves: Mapping[str, Sequence[float]], path: str | os.PathLike, *,
                          title: str = "") -> None:
  """Test accuracy of the running average vs number of clients averaged (NTK-DFL Fig. 6).

  Args:
    curves: ``best_to_worst``, ``random``, ``worst_to_best`` -> ``[M]``
      accuracies (as :func:`ntk_fl.metrics.selection_curves` returns); when
      ``test_accuracy`` is present its histogram is drawn on a second axis.
    path: output PNG.
    title: optional figure title.
  """
  _save(selection_figure(curves, title=title), path)
