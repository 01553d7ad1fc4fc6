"""The pieces the gauges are drawn with: HTML bars, SVG sparklines, and the three views
(an ipywidgets HTML widget, an HTML display handle, a status line on stderr).

A view is handed the two renderings it may show (callables: only the one it shows is computed),
so it knows nothing of the `Gauges` that draws through it.
"""

from __future__ import annotations

import html
import importlib.util
import sys
import time
from typing import Callable

from .._units import format_bytes
from ..runtime import in_notebook

__all__ = ["sparkline"]

_COLORS = {"ok": "#2e7d32", "amber": "#f9a825", "red": "#c62828"}


def _level(frac: float | None, warn: float) -> str:
    if frac is None:
        return "ok"
    return "red" if frac >= warn else "amber" if frac >= warn - 0.15 else "ok"


def sparkline(values: list[float | None], width: int = 160, height: int = 28, color: str = "#1565c0",
              vmax: float | None = None) -> str:
    """An inline SVG polyline of `values` (None = gap), scaled to [0, vmax or max]."""
    points = [v for v in values if v is not None]
    if len(points) < 2:
        return f'<svg width="{width}" height="{height}"></svg>'
    top = vmax or max(points) or 1.0
    step = width / (len(values) - 1)
    coords = " ".join(f"{i * step:.1f},{height - 1 - (v / top) * (height - 2):.1f}"
                      for i, v in enumerate(values) if v is not None)
    return (f'<svg width="{width}" height="{height}" style="vertical-align:middle">'
            f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/></svg>')


def _bar(label: str, used: float | None, total: float | None, warn: float, text: str | None = None,
         layers: list[tuple[float, str]] = ()) -> str:
    frac = used / total if used is not None and total else None
    color = _COLORS[_level(frac, warn)]
    width = f"{min(frac, 1) * 100:.1f}%" if frac is not None else "0"
    inner = "".join(f'<div style="position:absolute;left:0;top:0;bottom:0;width:{min(v, 1) * 100:.1f}%;'
                    f'background:{c}"></div>' for v, c in layers)
    value = text or (f"{format_bytes(used)} / {format_bytes(total)}" if frac is not None else "n/a")
    return (f'<div style="display:flex;align-items:center;gap:8px;margin:2px 0">'
            f'<span style="width:110px">{html.escape(label)}</span>'
            f'<div style="position:relative;width:220px;height:12px;background:#e0e0e0;border-radius:3px;overflow:hidden">'
            f'<div style="position:absolute;left:0;top:0;bottom:0;width:{width};background:{color}"></div>{inner}</div>'
            f'<span style="font-family:monospace">{html.escape(value)}</span></div>')


class _WidgetView:
    threaded = True

    def __init__(self):
        import ipywidgets
        from IPython.display import display

        self.widget = ipywidgets.HTML(value="")
        display(self.widget)

    def show(self, render: Callable[[], str], render_text: Callable[[], str]) -> None:
        self.widget.value = render()

    def close(self, summary_html: str, summary_text: str) -> None:
        from IPython.display import HTML, display

        self.widget.close()  # widget state is not saved by Colab: leave plain HTML behind
        display(HTML(summary_html))


class _HtmlView:
    threaded = False  # display updates from a thread land in whatever cell runs

    def __init__(self):
        from IPython.display import HTML, display

        self.handle = display(HTML(""), display_id=True)

    def show(self, render: Callable[[], str], render_text: Callable[[], str]) -> None:
        from IPython.display import HTML

        self.handle.update(HTML(render()))

    def close(self, summary_html: str, summary_text: str) -> None:
        from IPython.display import HTML

        self.handle.update(HTML(summary_html))


class _TextView:
    threaded = False
    every = 30.0

    def __init__(self):
        self._last = 0.0

    def show(self, render: Callable[[], str], render_text: Callable[[], str]) -> None:
        if time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            print(render_text(), file=sys.stderr, flush=True)

    def close(self, summary_html: str, summary_text: str) -> None:
        print(summary_text, file=sys.stderr, flush=True)


def _choose_view(view: str):
    if view == "auto":
        if not in_notebook():
            view = "text"
        elif importlib.util.find_spec("ipywidgets") is not None:
            view = "widget"
        else:
            print("colab_kit: live gauges without ipywidgets refresh only between training steps; "
                  "`pip install ipywidgets` for the widget view", file=sys.stderr)
            view = "html"
    return {"widget": _WidgetView, "html": _HtmlView, "text": _TextView}[view]()
