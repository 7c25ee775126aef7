"""The run plots: whole-number ticks where counts are plotted, legends outside the data, labelled axes."""
from __future__ import annotations

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from ntk_fl import plotting
from ntk_fl.data import plots as data_plots


def _drawn(fig):
  canvas = FigureCanvasAgg(fig)
  canvas.draw()
  return canvas.get_renderer()


def _integer_ticks(ticks) -> bool:
  return all(float(t).is_integer() for t in ticks)


def test_accuracy_plot_has_integer_rounds_and_a_legend_clear_of_the_curves():
  rounds = np.arange(1, 8)
  acc = np.linspace(0.5, 0.9, 7)
  fig = plotting.accuracy_figure(rounds, acc, acc - 0.1, acc - 0.2, acc, title="t")
  renderer = _drawn(fig)
  ax = fig.axes[0]
  # Matplotlib's default locator puts ticks at 1.0, 1.5, 2.0, ... for seven rounds.
  assert _integer_ticks(ax.get_xticks())
  assert ax.get_xlabel() == "communication round" and "test set" in ax.get_ylabel()
  legend = ax.get_legend().get_window_extent(renderer)
  assert legend.y1 < ax.get_window_extent(renderer).y0   # below the axes, not over the data


def test_selection_plot_axes_explain_the_halves_and_count_whole_clients():
  m = 7
  curves = {"best_to_worst": np.linspace(0.7, 0.8, m), "random": np.linspace(0.6, 0.8, m),
            "worst_to_best": np.linspace(0.4, 0.8, m), "test_accuracy": np.linspace(0.4, 0.7, m)}
  fig = plotting.selection_figure(curves)
  renderer = _drawn(fig)
  curve_ax, hist_ax = fig.axes
  assert _integer_ticks(curve_ax.get_xticks()) and _integer_ticks(hist_ax.get_yticks())
  assert "validation half" in curve_ax.get_xlabel() and "test half" in curve_ax.get_ylabel()
  assert hist_ax.get_ylabel() == "number of clients" and "test half" in hist_ax.get_xlabel()
  assert curve_ax.get_legend().get_window_extent(renderer).y1 < curve_ax.get_window_extent(renderer).y0


def test_label_distribution_counts_are_whole_numbers(tmp_path):
  labels = np.array([0, 1, 1, 2, 2, 2])
  clients = [np.array([0, 1]), np.array([2, 3, 4, 5])]
  fig = data_plots.label_distribution_figure(labels, clients, 3)
  _drawn(fig)
  ax = fig.axes[0]
  # Two clients holding 2 and 4 samples: the default locators would tick 0.5 steps on both axes.
  assert _integer_ticks(ax.get_xticks()) and _integer_ticks(ax.get_yticks())
  assert ax.get_xlabel() == "client index" and "training samples" in ax.get_ylabel()
  path = tmp_path / "partition.png"
  data_plots.plot_label_distribution(labels, clients, 3, path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
