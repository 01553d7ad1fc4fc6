"""Live GPU and RAM gauges in the notebook, and a summary that stays after the run.

    with ck.Gauges(total_steps=1000) as g:          # or automatic inside run.train
        for step, batch in enumerate(loader):
            ...
            g.update(step=step, loss=loss.item())

The view is chosen once: an ipywidgets HTML widget in a notebook (core widgets only, works with
Colab's ipywidgets 7.7.1 and with 8.x), an HTML display handle without ipywidgets, a status
line on stderr outside a notebook. Updates come from the training loop (at most 2 per second):
Colab does not reliably repaint widgets changed from a background thread (colabtools #3373),
so the sampler thread pushes only when the loop has been silent for a while, and only to a
widget; it never prints or calls display(). Sparklines are hand-built SVG in one HTML string
(about 0.2 ms to build, where a matplotlib redraw costs 25-54 ms and holds the GIL).
"""

from __future__ import annotations

import html
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from .._units import format_age, format_bytes
from ..checkpoints import storage
from .monitor import History, Sample, Sampler
from .views import _COLORS, _bar, _choose_view, sparkline

__all__ = ["Gauges", "plot_history", "sparkline"]

PUSH_EVERY = 0.5  # seconds between view updates from the training loop
SILENT_AFTER = 2.0  # the sampler thread updates a widget when the loop was silent this long
RAM_WARN, GPU_WARN = 0.90, 0.95
_last: "Gauges | None" = None


class Gauges:
    """Live GPU/RAM gauges with history; a context manager, or `close()` when done.

    Args:
        total_steps: for the ETA.
        title: shown in the header (the run name inside `run.train`).
        local_dir: a folder whose free disk space is shown (the local scratch).
        drive_dir: a folder whose free disk space is shown (the persistent folder).
        save_html: where the final summary is written as a standalone HTML file.
        write: how it is written, `write(path, data)` (inside `run.train`: by the mirror's thread, so
            that the end of training never waits for Drive); default: at once.
        on_warn: called (from the sampler thread) with a message when host RAM passes 90 % of
            its limit or GPU memory 95 %, once per crossing.
        view: "auto", "widget", "html" or "text".
        interval: seconds between samples.
        all_gpus: also show the node's other visible GPUs (several processes: rank 0 shows them all).
    """

    def __init__(self, *, total_steps: int | None = None, title: str = "colab_kit", local_dir=None,
                 drive_dir=None, save_html: str | Path | None = None, on_warn: Callable[[str], None] | None = None,
                 view: str = "auto", interval: float = 1.0, all_gpus: bool = False,
                 write: Callable[[Path, bytes], None] | None = None):
        global _last
        self.title = title
        self.total_steps = total_steps
        self.save_html = Path(save_html) if save_html else None
        self._write = write or storage.atomic_write_bytes
        self.on_warn = on_warn
        self.history = History()
        self.status: dict = {}
        self.step: int | None = None
        self.loss: float | None = None
        self.warnings: list[str] = []
        self.closed = False
        self._armed = {"ram": True, "gpu": True}
        self._started = time.time()
        self._rate_origin: tuple[float, int] | None = None
        self._pushed = 0.0
        self._loop_seen = time.monotonic()
        self._lock = threading.Lock()
        self._view = _choose_view(view)
        self._sampler = Sampler(self.history, on_sample=self._on_sample, interval=interval,
                                disk_paths=(Path(local_dir) if local_dir else None,
                                            Path(drive_dir) if drive_dir else None), all_gpus=all_gpus)
        self._sampler.sample()
        self._push()
        self._sampler.start()
        _last = self

    # -- from the training loop ---------------------------------------------------------------
    def update(self, step: int | None = None, loss: float | None = None, **status) -> None:
        """Record progress and refresh the view (at most every 0.5 s). Main thread only."""
        now = time.monotonic()
        self._loop_seen = now
        if step is not None:
            self.step = int(step)
            if self._rate_origin is None:
                self._rate_origin = (now, self.step)
        if loss is not None:
            self.loss = float(loss)
            self.history.add_loss(time.time(), self.step or 0, self.loss)
        self.status.update(status)
        if now - self._pushed >= PUSH_EVERY:
            self._push()

    def _push(self) -> None:
        with self._lock:
            if not self.closed:
                self._pushed = time.monotonic()
                self._view.show(self.render, self.render_text)

    # -- from the sampler thread ---------------------------------------------------------------
    def _on_sample(self, sample: Sample) -> None:
        self._check(sample)
        if self._view.threaded and time.monotonic() - self._loop_seen >= SILENT_AFTER:
            self._push()

    def _check(self, sample: Sample) -> None:
        for key, used, total, limit, what in (
                ("ram", sample.host.used, sample.host.limit, RAM_WARN, "host RAM"),
                ("gpu", sample.gpu.used, sample.gpu.total, GPU_WARN, "GPU memory")):
            if used is None or not total:
                continue
            frac = used / total
            if frac >= limit and self._armed[key]:
                self._armed[key] = False
                message = (f"{what} at {frac:.0%} of {format_bytes(total)}"
                           + (": the runtime is killed when it is full; lower the batch or sequence "
                              "length, or free data you no longer need" if key == "ram" else
                              ": the next larger batch may run out of memory"))
                self.warnings.append(message)
                if self.on_warn is not None:
                    self.on_warn(message)
            elif frac < limit - 0.05:
                self._armed[key] = True

    # -- rendering -----------------------------------------------------------------------------
    def _rate(self) -> float | None:
        if self._rate_origin is None or self.step is None:
            return None
        seconds = time.monotonic() - self._rate_origin[0]
        done = self.step - self._rate_origin[1]
        return done / seconds if seconds > 0 and done > 0 else None

    def status_line(self) -> str:
        parts = [self.title]
        if self.step is not None:
            parts.append(f"step {self.step}" + (f"/{self.total_steps}" if self.total_steps else ""))
        rate = self._rate()
        if rate:
            parts.append(f"{rate:.2f} steps/s")
            if self.total_steps and self.step is not None:
                parts.append(f"ETA {format_age((self.total_steps - self.step) / rate)}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4g}")
        if self.status.get("saved_step") is not None:
            parts.append(f"checkpoint {self.status['saved_step']} saved")
        if self.status.get("cloud"):
            parts.append(self.status["cloud"])  # what is in the cloud, what is pending (cloud.py)
        if self.status.get("session"):
            parts.append(self.status["session"])  # start_run(time_limit=...): what is left of the session
        if self.status.get("oom_backoffs"):
            parts.append(f"OOM back-offs {self.status['oom_backoffs']} (micro-batch {self.status.get('micro_batch')})")
        return " · ".join(parts)

    def _series(self, fn) -> list:
        return [fn(s) for s in self.history.samples[-120:]]

    def render(self) -> str:
        s = self.history.samples[-1]
        gpu, tr, host = s.gpu, s.torch, s.host
        layers = []
        if gpu.total and tr.reserved is not None:
            layers = [(tr.reserved / gpu.total, "rgba(21,101,192,.45)"), (tr.allocated / gpu.total, "#1565c0")]
        rows = [
            _bar("GPU memory", gpu.used, gpu.total, GPU_WARN, layers=layers),
            _bar("PyTorch", tr.allocated, gpu.total, GPU_WARN,
                 text=(f"allocated {format_bytes(tr.allocated)}, reserved {format_bytes(tr.reserved)}, "
                       f"peak {format_bytes(tr.peak_allocated)}") if tr.allocated is not None else "n/a"),
            _bar("GPU busy", gpu.util, 100.0 if gpu.util is not None else None, 2.0,
                 text=f"{gpu.util:.0f} %" + (f", {gpu.temperature:.0f} °C, {gpu.power:.0f} W"
                                             if gpu.temperature is not None and gpu.power is not None else "")
                 if gpu.util is not None else "n/a"),
            *(_bar(f"GPU {i} memory", other.used, other.total, GPU_WARN,
                   text=f"{format_bytes(other.used)} / {format_bytes(other.total)}"
                        + (f", busy {other.util:.0f} %" if other.util is not None else ""))
              for i, other in enumerate(s.others, start=1)),
            _bar("host RAM", host.used, host.limit, RAM_WARN,
                 text=(f"{format_bytes(host.used)} / {format_bytes(host.limit)} (this process "
                       f"{format_bytes(host.rss)})") if host.used is not None else None),
        ]
        sparks = [("GPU memory", self._series(lambda x: x.gpu.used), gpu.total, "#1565c0"),
                  ("host RAM", self._series(lambda x: x.host.used), host.limit, "#6a1b9a"),
                  ("GPU busy", self._series(lambda x: x.gpu.util), 100, "#00838f"),
                  ("loss", [l for _, _, l in self.history.losses[-120:]], None, "#ef6c00")]
        spark_html = "".join(f'<div style="display:inline-block;margin:4px 14px 0 0;color:#616161">{name}<br>'
                             f'{sparkline(v, vmax=m, color=c)}</div>'
                             for name, v, m, c in sparks if any(x is not None for x in v))
        disk = s.disk
        disk_text = ", ".join(f"{where} {format_bytes(free)}" for where, free in
                              (("local", disk.local_free), ("Drive", disk.drive_free)) if free is not None)
        disk_text = f"disk free: {disk_text}" if disk_text else ""
        warn = "".join(f'<div style="color:{_COLORS["red"]};font-weight:bold">⚠ {html.escape(w)}</div>'
                       for w in self.warnings[-2:])
        return (f'<div style="font-family:sans-serif;font-size:12px;line-height:1.4">'
                f'<div style="font-weight:bold">{html.escape(self.status_line())}</div>{warn}'
                f'{"".join(rows)}<div>{spark_html}</div><div style="color:#616161">{disk_text}</div></div>')

    def render_text(self) -> str:
        s = self.history.samples[-1]
        gpu = (f"GPU {format_bytes(s.gpu.used)}/{format_bytes(s.gpu.total)}" if s.gpu.total else "GPU n/a")
        gpu += "".join(f" | GPU{i} {format_bytes(o.used)}/{format_bytes(o.total)}"
                       for i, o in enumerate(s.others, start=1) if o.total)
        return (f"[{self.status_line()}] {gpu} | RAM {format_bytes(s.host.used)}/{format_bytes(s.host.limit)}"
                + (f" | WARNING: {self.warnings[-1]}" if self.warnings else ""))

    def summary(self, error: str | None = None) -> tuple[str, str]:
        """The final (html, text) summary: outcome, peaks and timelines."""
        peaks = self.history.peaks
        last = self.history.samples[-1]
        minutes = format_age(time.time() - self._started)
        outcome = f"failed: {error}" if error else "finished"
        color = _COLORS["red"] if error else _COLORS["ok"]
        facts = [("duration", minutes), ("steps", f"{self.step}" if self.step is not None else "n/a"),
                 ("final loss", f"{self.loss:.4g}" if self.loss is not None else "n/a"),
                 ("peak GPU memory", f"{format_bytes(peaks.get('gpu_used'))} of {format_bytes(last.gpu.total)}"),
                 ("peak PyTorch allocated", format_bytes(peaks.get("peak_allocated"))),
                 ("peak PyTorch reserved", format_bytes(peaks.get("reserved"))),
                 ("peak host RAM", f"{format_bytes(peaks.get('host_used'))} of {format_bytes(last.host.limit)}"),
                 ("peak process RSS", format_bytes(peaks.get("peak_rss") or peaks.get("rss")))]
        timeline = [("GPU memory", [s.gpu.used for s in self.history.samples], last.gpu.total, "#1565c0"),
                    ("host RAM", [s.host.used for s in self.history.samples], last.host.limit, "#6a1b9a"),
                    ("loss", [l for _, _, l in self.history.losses], None, "#ef6c00")]
        rows = "".join(f"<tr><td>{k}</td><td style='font-family:monospace'>{html.escape(v)}</td></tr>" for k, v in facts)
        lines = "".join(f"<div>{name}<br>{sparkline(v, width=480, height=48, vmax=m, color=c)}</div>"
                        for name, v, m, c in timeline if sum(x is not None for x in v) >= 2)
        warnings = "".join(f"<li>{html.escape(w)}</li>" for w in self.warnings)
        html_text = (f'<div style="font-family:sans-serif;font-size:12px">'
                     f'<div style="font-weight:bold;color:{color}">{html.escape(self.title)} · colab_kit gauges '
                     f'summary · {html.escape(outcome)}</div><table>{rows}</table>'
                     + (f"<div>warnings:<ul>{warnings}</ul></div>" if warnings else "") + f"{lines}</div>")
        text = (f"{self.title}: {outcome}; " + "; ".join(f"{k} {v}" for k, v in facts)
                + (f"; warnings: {' | '.join(self.warnings)}" if self.warnings else ""))
        return html_text, text

    # -- the end -------------------------------------------------------------------------------
    def close(self, error: str | None = None) -> str:
        """Stop sampling and leave the static summary (in red when `error`); idempotent."""
        if self.closed:
            return self.summary(error)[0]
        self._sampler.stop()
        with self._lock:
            self.closed = True
        summary_html, summary_text = self.summary(error)
        self._view.close(summary_html, summary_text)
        if self.save_html is not None:
            try:
                self._write(self.save_html, (
                    "<!doctype html><meta charset='utf-8'><title>colab_kit gauges</title>"
                    + summary_html).encode())
            except OSError as exc:
                print(f"colab_kit: could not write {self.save_html}: {exc}", file=sys.stderr)
        return summary_html

    def __enter__(self) -> "Gauges":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(error=f"{exc_type.__name__}: {exc}" if exc_type else None)


def plot_history(gauges: Gauges | None = None):
    """A matplotlib figure of GPU memory, host RAM and loss over the run (default: the latest gauges)."""
    import matplotlib.pyplot as plt

    gauges = gauges or _last
    if gauges is None:
        raise ValueError("no gauges have run in this session; pass the Gauges object: ck.plot_history(g)")
    samples = gauges.history.samples
    t0 = samples[0].t if samples else 0.0
    minutes = [(s.t - t0) / 60 for s in samples]
    gib = 1024 ** 3
    fig, (mem, ram, loss) = plt.subplots(3, 1, figsize=(8, 7), sharex=False)
    for label, values in (("GPU used (NVML)", [s.gpu.used for s in samples]),
                          ("PyTorch reserved", [s.torch.reserved for s in samples]),
                          ("PyTorch allocated", [s.torch.allocated for s in samples])):
        if any(v is not None for v in values):
            mem.plot(minutes, [v / gib if v is not None else float("nan") for v in values], label=label)
    mem.set_ylabel("GiB")
    mem.set_title("GPU memory")
    ram.plot(minutes, [s.host.used / gib if s.host.used else float("nan") for s in samples], label="used")
    ram.plot(minutes, [s.host.rss / gib if s.host.rss else float("nan") for s in samples], label="this process")
    if samples and samples[-1].host.limit:
        ram.axhline(samples[-1].host.limit / gib, color="red", linestyle="--", label="limit")
    ram.set_ylabel("GiB")
    ram.set_xlabel("minutes")
    ram.set_title("host RAM")
    if gauges.history.losses:
        loss.plot([s for _, s, _ in gauges.history.losses], [l for _, _, l in gauges.history.losses])
    loss.set_xlabel("step")
    loss.set_title("loss")
    for axis in (mem, ram):
        if axis.get_legend_handles_labels()[0]:
            axis.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig
