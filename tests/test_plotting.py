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
  assert legend.y1 < ax.get_window_extent(renderer).y0  # below the axes, not over the data
  # The data: the aggregated curve and the client mean at their rounds, the band from min to max.
  aggregated, mean = ax.get_lines()
  np.testing.assert_array_equal(aggregated.get_xdata(), rounds)
  np.testing.assert_allclose(aggregated.get_ydata(), acc)
  np.testing.assert_allclose(mean.get_ydata(), acc - 0.1)
  (band,) = ax.collections
  vertices = {(float(x), round(float(y), 6)) for x, y in band.get_paths()[0].vertices}
  for r, low, high in zip(rounds, acc - 0.2, acc):  # the band spans [min, max] at every round
    assert {(float(r), round(low, 6)), (float(r), round(high, 6))} <= vertices, r


def test_accuracy_plot_skips_rounds_that_were_not_evaluated():
  fig = plotting.accuracy_figure(
    [1, 2, 3, 4], [0.5, None, 0.7, float("nan")], [None] * 4, [None] * 4, [None] * 4
  )
  (aggregated,) = fig.axes[0].get_lines()  # no client curve: none was evaluated
  np.testing.assert_array_equal(aggregated.get_xdata(), [1, 3])
  np.testing.assert_allclose(aggregated.get_ydata(), [0.5, 0.7])


def test_selection_plot_axes_explain_the_halves_and_count_whole_clients():
  m = 7
  curves = {
    "best_to_worst": np.linspace(0.7, 0.8, m),
    "random": np.linspace(0.6, 0.8, m),
    "worst_to_best": np.linspace(0.4, 0.8, m),
    "test_accuracy": np.linspace(0.4, 0.7, m),
  }
  fig = plotting.selection_figure(curves)
  renderer = _drawn(fig)
  curve_ax, hist_ax = fig.axes
  assert _integer_ticks(curve_ax.get_xticks()) and _integer_ticks(hist_ax.get_yticks())
  assert "validation half" in curve_ax.get_xlabel() and "test half" in curve_ax.get_ylabel()
  assert hist_ax.get_ylabel() == "number of clients" and "test half" in hist_ax.get_xlabel()
  assert (
    curve_ax.get_legend().get_window_extent(renderer).y1 < curve_ax.get_window_extent(renderer).y0
  )
  # The data: each curve against k = 1..M, and a histogram of the M clients' own accuracies.
  plotted = {line.get_label(): line for line in curve_ax.get_lines()}
  assert len(plotted) == 3
  for name in ("best_to_worst", "random", "worst_to_best"):
    line = plotted[plotting._SELECTION_STYLE[name][0]]
    np.testing.assert_array_equal(line.get_xdata(), np.arange(1, m + 1))
    np.testing.assert_allclose(line.get_ydata(), curves[name])
  heights = [patch.get_height() for patch in hist_ax.patches]
  counts, edges = np.histogram(curves["test_accuracy"], bins=20)
  assert sum(heights) == m
  np.testing.assert_array_equal(heights, counts)
  np.testing.assert_allclose(
    [patch.get_x() for patch in hist_ax.patches], edges[:-1]
  )  # where they lie


def test_label_distribution_counts_are_whole_numbers(tmp_path):
  labels = np.array([0, 1, 1, 2, 2, 2])
  clients = [np.array([0, 1]), np.array([2, 3, 4, 5])]
  fig = data_plots.label_distribution_figure(labels, clients, 3)
  _drawn(fig)
  ax = fig.axes[0]
  # Two clients holding 2 and 4 samples: the default locators would tick 0.5 steps on both axes.
  assert _integer_ticks(ax.get_xticks()) and _integer_ticks(ax.get_yticks())
  assert ax.get_xlabel() == "client index" and "training samples" in ax.get_ylabel()
  # The data: per client, a stacked bar per class whose height is its count (client 0: 1 of class 0, 1 of
  # class 1; client 1: 1 of class 1, 3 of class 2).
  bars = sorted(
    (round(p.get_x() + p.get_width() / 2), p.get_y(), p.get_height()) for p in ax.patches
  )
  counts = data_plots.class_counts(labels, clients, 3)
  np.testing.assert_array_equal(counts, [[1, 1, 0], [0, 1, 3]])
  for client in (0, 1):
    stacked = [(y, h) for x, y, h in bars if x == client and h > 0]
    assert sorted(h for _, h in stacked) == sorted(c for c in counts[client] if c)
    assert (
      max(y + h for y, h in stacked) == counts[client].sum()
    )  # the stack reaches the client's size
  path = tmp_path / "partition.png"
  data_plots.plot_label_distribution(labels, clients, 3, path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _lines(bits=True):
  """Five metrics lines: scored in rounds 1, 2, 4, 5 (not round 3), a training loss every round."""
  acc = [0.5, 0.6, None, 0.75, 0.8]
  out = []
  for r in range(1, 6):
    scored = acc[r - 1] is not None
    line = {
      "round": r,
      "test_acc": acc[r - 1],
      "test_loss": 2.0 / r if scored else None,
      "client_loss_mean": 2.5 / r if scored else None,
      "loss_mean": 1.0 / r,
      "loss_min": 0.5 / r,
      "loss_max": 1.5 / r,
    }
    if bits:
      line["bits_cumulative"] = 1e6 * r
    out.append(line)
  return out


def _curve(ax, label):
  (line,) = [l for l in ax.get_lines() if l.get_label() == label]
  return np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)


def test_loss_figure_plots_the_recorded_losses_and_skips_unscored_rounds():
  fig = plotting.loss_figure(_lines(), title="t")
  _drawn(fig)
  ax = fig.axes[0]
  x, y = _curve(ax, "aggregated model: test loss")
  np.testing.assert_array_equal(x, [1, 2, 4, 5])
  np.testing.assert_allclose(y, [2.0, 1.0, 0.5, 0.4])
  x, y = _curve(ax, "clients' own models: mean test loss")
  np.testing.assert_allclose(y, [2.5, 1.25, 0.625, 0.5])
  x, y = _curve(ax, "training loss: mean over clients")
  np.testing.assert_array_equal(x, [1, 2, 3, 4, 5])
  np.testing.assert_allclose(y, 1.0 / np.arange(1, 6))
  band = ax.collections[0].get_paths()[0].vertices
  assert band[:, 1].min() == 0.5 / 5 and band[:, 1].max() == 1.5  # training loss: min-to-max band
  assert ax.get_yscale() == "log" and _integer_ticks(ax.get_xticks())
  assert plotting.loss_figure([{"round": 1, "test_acc": 0.5}]) is None


def test_communication_figure_plots_accuracy_against_bits_sent():
  fig = plotting.communication_figure(_lines())
  _drawn(fig)
  ax = fig.axes[0]
  x, y = _curve(ax, "aggregated model (mean of client weights)")
  np.testing.assert_allclose(x, [1e6, 2e6, 4e6, 5e6])  # round 3 had bits but no accuracy
  np.testing.assert_allclose(y, [0.5, 0.6, 0.75, 0.8])
  assert "bits sent" in ax.get_xlabel() and "accuracy" in ax.get_ylabel()
  assert plotting.communication_figure(_lines(bits=False)) is None


def test_plot_run_writes_png_and_pdf_of_each_figure(tmp_path):
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top

  assert plotting.ACCURACY_PLOT == rundir.ACCURACY_PLOT
  written = plotting.plot_run(_lines(), tmp_path, title="run")
  assert written == [plotting.ACCURACY_PLOT, plotting.LOSS_PLOT, plotting.COMMUNICATION_PLOT]
  for name in written:
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pdf = (tmp_path / name).with_suffix(".pdf").read_bytes()
    assert pdf[:5] == b"%PDF-" and b"/Type /Page" in pdf
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
    [*written, *(n.replace(".png", ".pdf") for n in written)]
  )  # no temporary files left
  other = tmp_path / "no_bits"
  other.mkdir()
  written = plotting.plot_run(_lines(bits=False), other)
  assert written == [plotting.ACCURACY_PLOT, plotting.LOSS_PLOT]
