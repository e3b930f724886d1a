"""Progress output of `sat train`: a rich progress bar on a TTY, plain log lines otherwise."""

from __future__ import annotations

import sys
import time

from sat_cli import metric_names as M


class Progress:
    def __init__(self, total: int, start: int = 0, *, every: int = 10, tty: bool | None = None):
        self.total, self.every = total, every
        self.t0 = time.perf_counter()
        self.start = start
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._bar = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def log(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.console.print(msg)
        else:
            print(msg, flush=True)

    def step(self, t: int, m: dict) -> None:
        done = t + 1
        info = (
            f"reward {m.get(M.REWARD_MEAN, 0):.3f}  lag {m.get(M.VERSION_LAG_MEAN, 0):.1f}"
            f"  d̄π {m.get(M.DPI, float('nan')):.4f}"
            f"  {m.get(M.TOKENS_PER_S, 0):,.0f} tok/s"
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=done, info=info)
            return
        if done % self.every == 0 or done == self.total or done == self.start + 1:
            el = time.perf_counter() - self.t0
            eta = el / (done - self.start) * (self.total - done)
            print(f"step {done:>5}/{self.total}  {info}  {el:6.1f}s  eta {eta:5.0f}s", flush=True)

    def eval(self, step: int, res) -> None:
        """One line of an evaluation's ``shown`` metrics (``res``: a ``loop.parts.EvalScores``)."""
        m = res.metrics
        vals = "  ".join(f"{k.split('/')[-1]} {m[k]:.1f}" for k in res.shown)
        self.log(f"eval @ step {step}: {vals}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
