"""The report's figures: one per question, one line per variant, a variant in the same colour everywhere."""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from fast.targets import Target
from fast.tools.report import series
from fast.tools.report.runs import Run

FIGURE_SIZE_IN = (8.0, 3.4)
DPI = 130
AXES_RIGHT = 0.76  # the rest of the width holds the legend
LEGEND_CHARS = 24
STYLE = {
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e4e4e4",
    "grid.linewidth": 0.6,
    "axes.edgecolor": "#888888",
    "axes.titlesize": 10,
    "legend.frameon": False,
    "lines.linewidth": 1.6,
    "axes.axisbelow": True,
}


@dataclass(frozen=True)
class Variant:
    """A run as it appears in the figures: its label, colour and line style."""

    run: Run
    label: str
    colour: str
    linestyle: str


@dataclass(frozen=True)
class ReportFigure:
    """A figure as base64 PNG, or None when there was nothing to draw; the note says what is missing."""

    title: str
    png_base64: str | None
    note: str = ""


def variants(runs: list[Run], labels: list[str]) -> list[Variant]:
    """Give every run a colour (tab10, tab20 beyond ten) and, beyond twenty, a different line style."""
    palette = matplotlib.colormaps["tab10" if len(runs) <= 10 else "tab20"].colors
    styles = ["-", "--", ":", "-."]
    return [
        Variant(run, label, matplotlib.colors.to_hex(palette[i % len(palette)]), styles[i // len(palette) % 4])
        for i, (run, label) in enumerate(zip(runs, labels, strict=True))
    ]


@dataclass(frozen=True)
class LinePlot:
    """A figure of one curve per variant: what to draw and how to label it."""

    title: str
    curve: Callable[[Run], series.Curve]
    x_label: str
    y_label: str
    percent: bool = False
    markers: bool = False
    steps: bool = False
    log_scale_when_wide: bool = False
    counts: bool = False  # the y values are whole numbers (workers)
    note: Callable[[list[Variant]], str] | None = None  # what the curves leave out or add, in words


def _bytes_at_the_end_note(all_variants: list[Variant]) -> str:
    """Which curves' last step adds bytes that no record showed over time (a server's, mostly), and how many."""
    added = []
    for v in all_variants:
        missing = series.megabytes_not_in_records(v.run)
        total = (v.run.summary.get("bytes_sent") or 0) / series.MEGABYTE
        if missing > 0.01 * total:  # (the workers' few steps after their last record are not worth a word)
            servers = v.run.summary.get("servers") or 0
            whose = f"from its server{'s' if servers > 1 else ''}" if servers else "after the workers' last records"
            added.append(f"{v.label}: {missing:,.1f} MB {whose}")
    if not added:
        return ""
    return (
        "Each curve ends at its run's total, the table's MB sent. Servers keep no records over time, so what they "
        f"sent is the curve's last step, at the end of the run ({'; '.join(added)})."
    )


LINE_PLOTS = [
    LinePlot("Test accuracy vs epochs", lambda run: series.accuracy_curve(run, "epoch"), "epoch",
             "test accuracy", percent=True, markers=True),
    LinePlot("Test accuracy vs wall time", lambda run: series.accuracy_curve(run, "time_s"), "wall time (s)",
             "test accuracy", percent=True, markers=True),
    LinePlot("Training loss vs wall time", series.loss_curve, "wall time (s)",
             "training loss (mean over workers)"),
    LinePlot("Cumulative MB sent vs wall time", series.megabytes_sent_curve, "wall time (s)",
             "MB sent (workers and servers)", steps=True, note=_bytes_at_the_end_note),
    LinePlot("Replica divergence vs wall time", series.divergence_curve, "wall time (s)",
             "divergence  ‖wᵢ − w̄‖ / ‖w̄‖", log_scale_when_wide=True),
]  # fmt: skip
MEMBERSHIP_PLOT = LinePlot("Workers in the run vs wall time (live membership)", series.membership_curve,
                           "wall time (s)", "workers", markers=True, steps=True, counts=True)  # fmt: skip


def _metric_plots(targets: list[Target]) -> list[LinePlot]:
    """A curve of each metric a target names, beside test accuracy (e.g. validation perplexity)."""
    metrics = dict.fromkeys(t.metric for t in targets if t.metric not in ("accuracy", "loss"))
    return [
        LinePlot(
            f"Test {m} vs wall time",
            lambda run, m=m: series.metric_curve(run, m, "time_s"),
            "wall time (s)",
            f"test {m}",
            markers=True,
        )  # fmt: skip
        for m in metrics
    ]


def report_figures(all_variants: list[Variant], targets: list[float | Target]) -> list[ReportFigure]:
    """Every figure of the report, in reading order."""
    targets = series.ordered([series.as_target(t) for t in targets])
    plots = LINE_PLOTS[:2] + _metric_plots(targets) + LINE_PLOTS[2:]
    if any(v.run.summary.get("membership") for v in all_variants):  # a live run: who was in, when
        plots.append(MEMBERSHIP_PLOT)
    figures = [_line_figure(plot, all_variants) for plot in plots]
    figures.append(_staleness_figure(all_variants))
    figures.append(_time_to_target_figure(all_variants, targets))
    return figures


def _line_figure(plot: LinePlot, all_variants: list[Variant]) -> ReportFigure:
    curves = [(v, plot.curve(v.run)) for v in all_variants]
    drawn = [(v, xs, ys) for v, (xs, ys) in curves if xs]
    if not drawn:
        return ReportFigure(plot.title, None, "No data: no run recorded this.")
    with matplotlib.rc_context(STYLE):
        figure, axes = _new_figure()
        for v, xs, ys in drawn:
            axes.plot(
                xs,
                ys,
                color=v.colour,
                linestyle=v.linestyle,
                marker="o" if (plot.markers and len(xs) <= 40) or len(xs) == 1 else None,  # a lone point shows
                markersize=3.5,
                drawstyle="steps-post" if plot.steps else "default",
                label=v.label,
            )
        axes.set_xlabel(plot.x_label)
        axes.set_ylabel(plot.y_label)
        if plot.percent:
            axes.yaxis.set_major_formatter(PercentFormatter(xmax=1, decimals=0))
        if plot.log_scale_when_wide and _spans_decades([y for _, _, ys in drawn for y in ys], 2):
            axes.set_yscale("log")
        if plot.counts:
            axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlim(left=0)
        lone = [v.label for v, xs, _ in drawn if len(xs) == 1]
        notes = [_missing_note(curves), f"One point only: {', '.join(lone)}." if lone else ""]
        note = " ".join(filter(None, [*notes, plot.note(all_variants) if plot.note else ""]))
        return ReportFigure(plot.title, _encode(figure, axes), note)


def _staleness_figure(all_variants: list[Variant]) -> ReportFigure:
    title = "Staleness of applied updates"
    histograms = [(v, series.staleness_fractions(v.run)) for v in all_variants]
    drawn = [(v, h) for v, h in histograms if h]
    if not drawn:
        return ReportFigure(title, None, "No data: no run recorded a staleness histogram.")
    with matplotlib.rc_context(STYLE):
        figure, axes = _new_figure()
        width = 0.8 / len(drawn)
        for i, (v, histogram) in enumerate(drawn):
            offsets = [s - 0.4 + width * (i + 0.5) for s in histogram]
            axes.bar(offsets, list(histogram.values()), width=width, color=v.colour, label=v.label)
        axes.set_xlabel("staleness (updates the receiver advanced since the sender's copy)")
        axes.set_ylabel("fraction of applied updates")
        axes.yaxis.set_major_formatter(PercentFormatter(xmax=1, decimals=0))
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(axis="x", visible=False)
        return ReportFigure(title, _encode(figure, axes), _missing_note(histograms))


def _time_to_target_figure(all_variants: list[Variant], targets: list[Target]) -> ReportFigure:
    title = "Time to target accuracy" if all(t.metric == "accuracy" for t in targets) else "Time to target"
    times = {(v.label, t): series.time_to_target(v.run, t) for v in all_variants for t in targets}
    if not targets or all(value is None for value in times.values()):
        return ReportFigure(title, None, "No data: no target was set or evaluated.")
    reached = [value for value in times.values() if isinstance(value, float | int)]
    label_height = max(reached, default=1.0) * 0.03
    with matplotlib.rc_context(STYLE):
        figure, axes = _new_figure()
        width = 0.8 / len(all_variants)
        for i, v in enumerate(all_variants):
            for j, target in enumerate(targets):
                x = j - 0.4 + width * (i + 0.5)
                value = times[(v.label, target)]
                if isinstance(value, float | int):
                    axes.bar(x, value, width=width, color=v.colour, label=v.label if j == 0 else None)
                    continue
                # An empty slot would read as "zero seconds": say in words what happened instead.
                word = "not reached" if value == series.NOT_REACHED else "no data"
                axes.bar(x, 0, width=width, color=v.colour, label=v.label if j == 0 else None)
                axes.text(x, label_height, word, rotation=90, ha="center", va="bottom", fontsize=7.5, color=v.colour)
        names = [f"{t.value * 100:g}% test accuracy" if t.metric == "accuracy" else t.label for t in targets]
        axes.set_xticks(range(len(targets)), names)
        axes.set_ylabel("seconds to reach target")
        axes.grid(axis="x", visible=False)
        if not reached:
            axes.set_ylim(0, 1)
        return ReportFigure(title, _encode(figure, axes))


def _new_figure() -> tuple[Figure, Axes]:
    # Fixed margins rather than an automatic layout, so every figure's axes line up on the page.
    figure = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI)
    figure.subplots_adjust(left=0.085, right=AXES_RIGHT, bottom=0.15, top=0.96)
    return figure, figure.add_subplot()


def _encode(figure: Figure, axes: Axes) -> str:
    handles, labels = axes.get_legend_handles_labels()
    labels = [label if len(label) <= LEGEND_CHARS else label[: LEGEND_CHARS - 1] + "…" for label in labels]
    figure.legend(handles, labels, loc="upper left", bbox_to_anchor=(AXES_RIGHT + 0.015, 0.97), fontsize=8.5)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, facecolor="white")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _missing_note(per_variant: list[tuple[Variant, object]]) -> str:
    missing = [v.label for v, data in per_variant if not (data[0] if isinstance(data, tuple) else data)]
    return f"Not recorded by {', '.join(missing)}." if missing else ""


def _spans_decades(values: list[float], decades: float) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and bool(positive) and math.log10(max(positive) / min(positive)) > decades
