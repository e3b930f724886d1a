"""The plots of `sat report`, drawn with matplotlib on the ``Agg`` canvas (never ``pyplot``, as
``tracking/histograms.py`` draws the tracker's histogram images).

``series_plot`` (one panel per lag; per row the mean over seeds at the
steps all its seeds logged, with a shaded seed band: the 95 % t-interval of the mean, n >= 2),
``eval_ess_plot`` (the eval curves above the ESS curves, one column per lag) and
``hist_grid_plot`` (the last ``|d|`` histogram of each row × lag). Each returns False, and
writes nothing, when there is nothing to draw.
"""

from __future__ import annotations

import math

import numpy as np


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
