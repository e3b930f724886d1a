"""Small matplotlib helpers: histograms as PNG images for MLflow and reports.

matplotlib is imported lazily, and figures are drawn on the non-interactive ``Agg`` canvas
directly (``matplotlib.figure.Figure`` + ``FigureCanvasAgg``), never through ``pyplot``: this works
on headless machines and from worker threads, does not change the process-wide backend, and
concurrent callers cannot draw on each other's figures.

``histogram_stats`` computes the numbers behind a histogram (``numpy.histogram`` bin edges and
counts plus summary statistics); ``histogram_image`` draws them as a ``PIL.Image`` (what
``MlflowClient.log_image`` accepts), ``histogram_png`` returns the same picture as PNG bytes.
Non-finite values are left out of the bins and counted in ``stats["nonfinite"]``.

The plots of `sat report`: ``series_plot`` (one panel per lag; per row the mean over seeds at the
steps all its seeds logged, with a shaded seed band: the 95 % t-interval of the mean, n >= 2),
``eval_ess_plot`` (the eval curves above the ESS curves, one column per lag) and
``hist_grid_plot`` (the last ``|d|`` histogram of each row × lag). Each returns False, and
writes nothing, when there is nothing to draw.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_MARK_COLORS = ("tab:red", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink")


def histogram_stats(values: Any, bins: int | Sequence[float] | str = 50) -> dict[str, Any]:
    """Bin edges, counts and summary statistics of the finite entries of ``values``.

    ``values``: anything ``numpy.asarray`` takes, or a torch tensor.
    ``bins`` is passed to ``numpy.histogram`` unchanged (an int, explicit edges, or a numpy rule
    name such as ``"auto"``). An empty input gives empty ``counts``/``edges`` and ``None`` stats.
    """
    if hasattr(values, "detach"):  # a torch tensor (possibly on GPU / requiring grad)
        values = values.detach().float().cpu().numpy()
    arr = np.asarray(values, dtype=np.float64).ravel()
    finite = arr[np.isfinite(arr)]
    out: dict[str, Any] = {"n": int(finite.size), "nonfinite": int(arr.size - finite.size)}
    if finite.size == 0:
        out.update(counts=[], edges=[], mean=None, std=None, min=None, max=None)
        out.update(p50=None, p90=None, p99=None)
        return out
    counts, edges = np.histogram(finite, bins=bins)
    p50, p90, p99 = np.quantile(finite, [0.5, 0.9, 0.99])
    out.update(
        counts=[int(c) for c in counts],
        edges=[float(e) for e in edges],
        mean=float(finite.mean()),
        std=float(finite.std()),
        min=float(finite.min()),
        max=float(finite.max()),
        p50=float(p50),
        p90=float(p90),
        p99=float(p99),
    )
    return out


def _figure(
    stats: Mapping[str, Any],
    *,
    title: str,
    marks: Mapping[str, float] | None,
    xlabel: str,
    logy: bool,
):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    edges = np.asarray(stats["edges"], dtype=np.float64)
    counts = np.asarray(stats["counts"], dtype=np.float64)
    if counts.size:
        ax.stairs(counts, edges, fill=True, color="tab:blue", alpha=0.75)
    else:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
    for i, (name, x) in enumerate((marks or {}).items()):
        if x is None or not np.isfinite(x):
            continue
        color = _MARK_COLORS[i % len(_MARK_COLORS)]
        ax.axvline(float(x), color=color, linestyle="--", linewidth=1.5, label=f"{name} = {x:.4g}")
    if marks:
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="upper right", fontsize=8)
    if logy and counts.size and counts.max() > 0:
        ax.set_yscale("symlog", linthresh=1.0)
    n, bad = stats["n"], stats["nonfinite"]
    subtitle = f"n={n}" + (f", non-finite={bad}" if bad else "")
    if stats.get("mean") is not None:
        subtitle += f", mean={stats['mean']:.4g}, p90={stats['p90']:.4g}"
    ax.set_title(f"{title}\n{subtitle}", fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    fig.tight_layout()
    return fig


def histogram_image(
    values: Any,
    *,
    title: str = "",
    marks: Mapping[str, float] | None = None,
    bins: int | Sequence[float] | str = 50,
    xlabel: str = "",
    logy: bool = False,
    stats: Mapping[str, Any] | None = None,
):
    """Histogram of ``values`` as an RGB ``PIL.Image.Image``.

    ``marks`` draws one dashed vertical line per entry (e.g. ``{"q": 0.12}``) with its value in
    the legend. Pass precomputed ``stats`` (from :func:`histogram_stats`) to draw exactly the bins
    that were logged as numbers.
    """
    from PIL import Image

    if stats is None:
        stats = histogram_stats(values, bins)
    fig = _figure(stats, title=title, marks=marks, xlabel=xlabel, logy=logy)
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())
    return Image.fromarray(rgba[..., :3].copy(), mode="RGB")


def histogram_png(values: Any, **kwargs) -> bytes:
    """Same picture as :func:`histogram_image` (same keywords), encoded as PNG bytes (for files
    and reports)."""
    img = histogram_image(values, **kwargs)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ----------------------------------------------------------------------------- report plots


def _canvas(nrows: int, ncols: int, figsize):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex="col")
    return fig, axes


def _color(i: int):
    from matplotlib import colormaps

    return colormaps["tab20"]((2 * i) % 20 + (i // 10) % 2)  # distinct hues first


def seed_band(series: list[dict[int, float]]):
    """``(steps, mean, lo, hi)`` at the steps every seed logged; ``lo, hi`` = the 95 %
    t-interval of the mean over seeds (equal to the mean for one seed)."""
    from sat_cli.report.stats import t_interval

    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    mean, lo, hi = [], [], []
    for t in steps:
        m, h, _ = t_interval([s[t] for s in series])
        h = 0.0 if h is None or not np.isfinite(h) else h
        mean.append(m)
        lo.append(m - h)
        hi.append(m + h)
    return steps, mean, lo, hi


def _draw_rows(ax, runs, rows, lag, key_of) -> None:
    for i, row in enumerate(rows):
        group = [r for r in runs if r.row == row and r.lag == lag and r.values(key_of(r))]
        if not group:
            continue
        steps, mean, lo, hi = seed_band([dict(r.values(key_of(r))) for r in group])
        if not steps:
            continue
        color = _color(i)
        ax.plot(
            steps, mean, label=row, color=color, lw=1.5, marker="." if len(steps) < 30 else None
        )
        if len(group) > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
    ax.grid(alpha=0.3)


def _legend(fig, axes, nrows_legend: int, height: float) -> None:
    handles, labels = [], []
    for ax in axes.ravel():
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, (0.22 * nrows_legend + 0.15) / height, 1, 0.97))


def series_plot(path, runs, rows, lags, key_of, title: str) -> bool:
    """One panel per lag: per row the mean over seeds and its shaded 95 % t-band."""
    if not any(r.values(key_of(r)) for r in runs):
        return False
    n_rows = len({r.row for r in runs})
    height = 4.0 + 0.22 * math.ceil(n_rows / 4)
    fig, axes = _canvas(1, len(lags), (max(5.5 * len(lags), 8), height))
    for j, lag in enumerate(lags):
        _draw_rows(axes[0][j], runs, rows, lag, key_of)
        axes[0][j].set_title(f"lag {lag}")
        axes[0][j].set_xlabel("step")
    axes[0][0].set_ylabel(title)
    fig.suptitle(f"{title} (mean over seeds; band: 95 % t-interval)")
    _legend(fig, axes, math.ceil(n_rows / 4), height)
    fig.savefig(path, dpi=110)
    return True


def eval_ess_plot(path, runs, rows, lags, eval_title: str, ess_key: str) -> bool:
    """Eval (top row) and the normalised ESS of pi/mu (bottom row) per lag, same step axis."""
    if not any(r.values(ess_key) for r in runs) or not any(r.eval for r in runs):
        return False
    n_rows = len({r.row for r in runs})
    height = 7.0 + 0.22 * math.ceil(n_rows / 4)
    fig, axes = _canvas(2, len(lags), (max(5.5 * len(lags), 8), height))
    for j, lag in enumerate(lags):
        _draw_rows(axes[0][j], runs, rows, lag, lambda r: r.eval_key or "")
        _draw_rows(axes[1][j], runs, rows, lag, lambda r: ess_key)
        axes[0][j].set_title(f"lag {lag}")
        axes[1][j].set_xlabel("step")
    axes[0][0].set_ylabel(eval_title)
    axes[1][0].set_ylabel("ESS / B of π/μ (Kish)")
    fig.suptitle("eval and effective sample size (mean over seeds; band: 95 % t-interval)")
    _legend(fig, axes, math.ceil(n_rows / 4), height)
    fig.savefig(path, dpi=110)
    return True


def hist_grid_plot(path, tables: dict, rows, lags) -> bool:
    """``|d|`` histograms side by side: rows = lags, columns = methods (``tables[(row, lag)]``:
    a tracker histogram table with ``edges``, ``counts``, ``marks``, ``step``, ``_seed``)."""
    if not tables:
        return False
    cols = [row for row in rows if any((row, lag) in tables for lag in lags)]
    fig, axes = _canvas(len(lags), len(cols), (2.6 * len(cols) + 1, 2.4 * len(lags) + 0.6))
    for i, lag in enumerate(lags):
        for j, row in enumerate(cols):
            ax = axes[i][j]
            t = tables.get((row, lag))
            if t is None:
                ax.set_axis_off()
                continue
            edges, counts = t.get("edges") or [], t.get("counts") or []
            if len(edges) == len(counts) + 1 and counts:
                ax.stairs(counts, edges, fill=True, alpha=0.6)
                if any(counts):
                    ax.set_yscale("log")
            for name, x in (t.get("marks") or {}).items():
                ax.axvline(x, ls="--", color="k", lw=0.8)
                ax.text(x, 1, f" {name}", transform=ax.get_xaxis_transform(), fontsize=6, va="top")
            ax.set_title(f"{row}\nlag {lag}, step {t.get('step')}, seed {t['_seed']}", fontsize=7)
            ax.tick_params(labelsize=6)
    fig.suptitle("|log π_θ − log μ| per token at the last logged step (d̄π histograms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
