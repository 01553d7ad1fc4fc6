"""The figure a benchmark script draws beside the table it prints (issue 48): the same numbers, a PNG under
`docs/figures/`, stamped with the date, the machine and the command, for the documentation's benchmark pages.

    add_arguments(parser, "checkpoint_pause")   # --figure docs/figures/checkpoint_pause.png, --no-figure
    fig, ax = figure()
    ax.bar(...)
    save(fig, args)                              # written and said on stdout

Every script takes `--figure PATH` (default `docs/figures/<script>.png`) and `--no-figure`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import date
from pathlib import Path

__all__ = ["add_arguments", "figure", "save", "machine"]

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--figure", type=Path, default=FIGURES / f"{name}.png",
                        help=f"where the figure goes (default: docs/figures/{name}.png)")
    parser.add_argument("--no-figure", action="store_true", help="print the table only")


def machine() -> str:
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores"
            + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU")
            + f", torch {torch.__version__}")


def figure(width: float = 7.5, height: float = 3.6, **subplots):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height), layout="constrained", **subplots)


def save(fig, args: argparse.Namespace) -> Path | None:
    """Stamp `fig` with the date, the machine and the command line, and write it to `args.figure`."""
    if args.no_figure:
        return None
    import matplotlib.pyplot as plt

    command = "python " + " ".join([f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    fig.text(0.005, 0.005, f"{date.today()} · {machine()} · {command}", fontsize=7, color="0.4", ha="left",
             va="bottom")
    fig.get_layout_engine().set(rect=(0, 0.04, 1, 0.96))
    path = Path(args.figure)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"figure: {path}")
    return path
