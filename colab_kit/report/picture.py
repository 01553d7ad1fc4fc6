"""The status picture: `status.png` in the run folder, which Drive's phone app and the Hub show as an image:
the loss over the steps, this runtime's memory over time, and each checkpoint from its save to the cloud.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, safe off the main thread).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

__all__ = ["Series", "render_picture"]


@dataclass
class Series:
    """What the picture draws; appended to by the run's threads (`reporter.py`), read under its lock."""

    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    memory: list[tuple[float, float, float | None]] = field(default_factory=list)  # (time, host GiB, GPU GiB)
    saves: dict[int, float] = field(default_factory=dict)  # step -> when saved
    clouds: dict[int, float] = field(default_factory=dict)  # step -> when confirmed in the cloud


def render_picture(series: Series, title: str, now: float | None = None) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    now = time.time() if now is None else now
    # Fixed margins, not a constrained layout: that layout solve is half the cost of a picture (0.17 s of a core
    # against 0.08 s measured), and the three panels' labels are known.
    fig = Figure(figsize=(7.0, 6.0))
    FigureCanvasAgg(fig)
    loss_ax, memory_ax, saves_ax = fig.subplots(3, 1)
    fig.subplots_adjust(left=0.19, right=0.97, top=0.92, bottom=0.08, hspace=0.65)
    fig.suptitle(f"{title} · {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(now))}", fontsize=10)
    _loss(loss_ax, series.losses)
    _memory(memory_ax, series.memory, now)
    _checkpoints(saves_ax, series.saves, series.clouds, now)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=80)
    return out.getvalue()


def _loss(ax, losses) -> None:
    ax.set_title("training loss", fontsize=9, loc="left")
    if losses:
        steps, values = zip(*losses)
        ax.plot(steps, values, color="#1565c0", lw=1.2)
    else:
        ax.text(0.5, 0.5, "no loss logged yet", ha="center", va="center", transform=ax.transAxes, color="0.5")
    ax.set_xlabel("step", fontsize=8)


def _memory(ax, memory, now: float) -> None:
    ax.set_title("memory of this runtime (GiB)", fontsize=9, loc="left")
    if memory:
        minutes = [(t - now) / 60 for t, _, _ in memory]
        ax.plot(minutes, [host for _, host, _ in memory], color="#6a1b9a", lw=1.2, label="host RAM (this process)")
        gpu = [(m, g) for m, (_, _, g) in zip(minutes, memory) if g is not None]
        if gpu:
            ax.plot(*zip(*gpu), color="#2e7d32", lw=1.2, label="GPU (PyTorch's allocator)")
        ax.legend(fontsize=7, loc="upper left")
    ax.set_xlabel("minutes before this picture", fontsize=8)


def _checkpoints(ax, saves: dict, clouds: dict, now: float) -> None:
    ax.set_title("checkpoints: saved (dot) to in the cloud (bar)", fontsize=9, loc="left")
    steps = sorted(set(saves) | set(clouds))[-12:]
    for row, step in enumerate(steps):
        saved = saves.get(step)
        cloud = clouds.get(step)
        if saved is not None:
            end = cloud if cloud is not None else now
            ax.plot([(saved - now) / 60, (end - now) / 60], [row, row], lw=5, solid_capstyle="butt",
                    color="#2e7d32" if cloud is not None else "#ef6c00")
            ax.plot([(saved - now) / 60], [row], "o", color="0.2", ms=3)
        elif cloud is not None:
            ax.plot([(cloud - now) / 60], [row], "s", color="#2e7d32", ms=4)
    ax.set_yticks(range(len(steps)), [f"checkpoint-{s}" for s in steps], fontsize=7)
    if not steps:
        ax.text(0.5, 0.5, "no checkpoint yet", ha="center", va="center", transform=ax.transAxes, color="0.5")
    ax.set_xlabel("minutes before this picture (green: in the cloud; orange: still uploading)", fontsize=8)
