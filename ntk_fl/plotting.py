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

__all__ = ["plot_accuracy", "plot_selection_curves"]

_SELECTION_STYLE = {  # NTK-DFL Fig. 6 colours: proposed order red, random green, lower bound blue
    "best_to_worst": ("best to worst", "tab:red"),
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
  """Axis labels, a light grid, the legend and the optional title of an accuracy plot."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  if title:
    ax.set_title(title)


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
  rounds = np.asarray(rounds)
  fig = Figure(figsize=(6, 4))
  ax = fig.add_subplot()
  agg = _as_float(aggregated)
  ok = ~np.isnan(agg)
  ax.plot(rounds[ok], agg[ok], "-o", ms=3, color="tab:blue", label="aggregated model")
  mean, low, high = _as_float(client_mean), _as_float(client_min), _as_float(client_max)
  ok = ~np.isnan(mean)
  if ok.any():
    ax.plot(rounds[ok], mean[ok], "--", color="tab:orange", label="mean client")
    ax.fill_between(rounds[ok], low[ok], high[ok], color="tab:orange", alpha=0.2, label="client min-max")
  _label_axes(ax, "round", "test accuracy", title)
  _save(fig, path)


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
  fig = Figure(figsize=(10, 4) if "test_accuracy" in curves else (6, 4))
  ax = fig.add_subplot(1, 2 if "test_accuracy" in curves else 1, 1)
  for name, (label, color) in _SELECTION_STYLE.items():
    acc = np.asarray(curves[name], dtype=float)
    ax.plot(np.arange(1, acc.size + 1), acc, color=color, label=label)
  _label_axes(ax, "number of clients averaged", "test accuracy (test half)", title)
  if "test_accuracy" in curves:
    hist = fig.add_subplot(1, 2, 2)
    hist.hist(np.asarray(curves["test_accuracy"], dtype=float), bins=20, color="tab:gray")
    hist.set_xlabel("single-client test accuracy")
    hist.set_ylabel("clients")
  _save(fig, path)
