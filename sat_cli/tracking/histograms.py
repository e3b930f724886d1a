"""Histograms for MLflow: the numbers and the picture (``tracking/artifacts.py`` logs both).

matplotlib is imported lazily, and figures are drawn on the non-interactive ``Agg`` canvas
directly (``matplotlib.figure.Figure`` + ``FigureCanvasAgg``), never through ``pyplot``: this works
on headless machines and from worker threads, does not change the process-wide backend, and
concurrent callers cannot draw on each other's figures.

``histogram_stats`` computes the numbers behind a histogram (``numpy.histogram`` bin edges and
counts plus summary statistics); ``histogram_image`` draws them as a ``PIL.Image`` (what
``MlflowClient.log_image`` accepts), ``histogram_png`` returns the same picture as PNG bytes.
Non-finite values are left out of the bins and counted in ``stats["nonfinite"]``.
"""

from __future__ import annotations

import io
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
    # fixed margins, not tight_layout (which draws the figure once more to measure it: half
    # of an image's cost): room for the two-line title, the axis labels and 6-digit ticks
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.13, top=0.86)
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
