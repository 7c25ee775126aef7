"""A picture of a partition: how many samples of each class every client holds."""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib
import numpy as np

# Figure + the Agg canvas directly (not pyplot): no global backend or figure state
# is touched, so this is safe on headless machines and inside other programs.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["class_counts", "label_distribution_figure", "plot_label_distribution"]


def class_counts(
  labels: np.ndarray, client_indices: Sequence[np.ndarray], num_classes: int
) -> np.ndarray:
  """``[M, C]`` int64 matrix: samples of class ``c`` held by client ``m``."""
  labels = np.asarray(labels)
  if (
    isinstance(num_classes, bool)
    or not isinstance(num_classes, (int, np.integer))
    or num_classes < 1
  ):
    raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(
      f"labels must lie in [0, num_classes={num_classes}), got range "
      f"[{labels.min()}, {labels.max()}]"
    )
  rows = [
    np.bincount(labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)
    for idx in client_indices
  ]
  return np.stack(rows) if rows else np.zeros((0, num_classes), dtype=np.int64)


def plot_label_distribution(
  labels: np.ndarray,
  client_indices: Sequence[np.ndarray],
  num_classes: int,
  path: str | os.PathLike,
  *,
  max_clients: int = 50,
) -> None:
  """Save a stacked bar chart of per-client class counts as a PNG (:func:`label_distribution_figure`).

  Args:
    path: output file (parent directories are created); the other arguments as
      in :func:`label_distribution_figure`.
  """
  fig = label_distribution_figure(labels, client_indices, num_classes, max_clients=max_clients)
  os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
  fig.savefig(path, format="png", dpi=100)


def label_distribution_figure(
  labels: np.ndarray,
  client_indices: Sequence[np.ndarray],
  num_classes: int,
  *,
  max_clients: int = 50,
) -> Figure:
  """A stacked bar chart of per-client class counts.

  Args:
    labels: ``[N]`` integer labels of the training set.
    client_indices: ``M`` index arrays into ``labels`` (a partition).
    num_classes: ``C``; labels must lie in ``[0, C)``.
    max_clients: plot only the first ``max_clients`` clients (bars stay readable).
  """
  if (
    isinstance(max_clients, bool)
    or not isinstance(max_clients, (int, np.integer))
    or max_clients < 1
  ):
    raise ValueError(f"max_clients must be an int >= 1, got {max_clients!r}")
  if len(client_indices) == 0:
    raise ValueError("client_indices is empty; nothing to plot")
  counts = class_counts(labels, client_indices[:max_clients], num_classes)  # [M', C]
  num_shown = counts.shape[0]

  fig = Figure(figsize=(max(6.0, 0.18 * num_shown + 2.0), 4.0), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  colors = _class_colors(num_classes)
  clients = np.arange(num_shown)
  bottom = np.zeros(num_shown)
  for c in range(num_classes):
    ax.bar(clients, counts[:, c], bottom=bottom, width=0.85, color=colors[c], label=str(c))
    bottom += counts[:, c]
  ax.set_xlabel("client index")
  ax.set_ylabel("training samples held (stacked by class)")
  ax.xaxis.set_major_locator(
    MaxNLocator(integer=True)
  )  # client indices and sample counts are whole numbers
  ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  shown = (
    f"first {num_shown} of {len(client_indices)}"
    if num_shown < len(client_indices)
    else f"{num_shown}"
  )
  ax.set_title(f"Class counts per client ({shown} clients)")
  ax.set_xlim(-0.6, num_shown - 0.4)
  if num_classes <= 20:
    ax.legend(title="class", fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
  return fig


def _class_colors(num_classes: int) -> list:
  """Distinct colours for up to 20 classes (tab10 / tab20), a continuous map beyond."""
  if num_classes <= 10:
    return [matplotlib.colormaps["tab10"](c) for c in range(num_classes)]
  if num_classes <= 20:
    return [matplotlib.colormaps["tab20"](c) for c in range(num_classes)]
  return [matplotlib.colormaps["viridis"](c / (num_classes - 1)) for c in range(num_classes)]
