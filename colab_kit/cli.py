"""Command line: run a notebook headless, inspect a run folder, or run the demo.

    python -m colab_kit run notebooks/rna_bert_classification.ipynb -p PRESET quick
    python -m colab_kit status drive/rna-bert
    python -m colab_kit demo
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

from ._units import format_age, format_bytes
from .checkpoint import CHECKPOINTS, list_checkpoints
from .journal import EVENTS, read_events
from .lease import lease_staleness, read_lease
from .manifest import read_manifest, verify_folder

__all__ = ["main"]


def _literal(text: str):
    """`-p MAX_STEPS 20` -> 20, `-p DRIVE_DIR None` -> None, `-p PRESET quick` -> "quick"."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def run_notebook(notebook: str, parameters: dict, output: str | None, timeout: int | None) -> int:
    try:
        import papermill
    except ImportError:
        print("running notebooks needs papermill: pip install papermill ipykernel", file=sys.stderr)
        return 2
    src = Path(notebook)
    if not src.is_file():
        print(f"no notebook at {src}", file=sys.stderr)
        return 2
    out = Path(output) if output else Path("outputs") / src.name
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"running {src} with {parameters or 'its default parameters'}; output notebook: {out}")
    started = time.monotonic()
    try:
        papermill.execute_notebook(str(src), str(out), parameters=parameters, cwd=str(Path.cwd()),
                                   log_output=True, progress_bar=False, execution_timeout=timeout)
    except papermill.PapermillExecutionError as exc:
        print(f"\nthe notebook failed in cell {exc.exec_count}: {exc.ename}: {exc.evalue}\n"
              f"see {out} for the full output", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - started:.0f} s; output notebook: {out}")
    return 0


def show_status(run_dir: str, events: int, quick: bool) -> int:
    root = Path(run_dir)
    if not root.is_dir():
        print(f"no run folder at {root} (a run folder holds checkpoints/ and events.jsonl)", file=sys.stderr)
        return 2
    print(f"run folder: {root.absolute()}")
    lease = read_lease(root)
    if lease is None:
        print("lease: none (no runtime is writing this run)")
    else:
        stale = lease_staleness(lease)
        state = f"stale: {stale}" if stale else "live"
        print(f"lease: host {lease.host}, pid {lease.pid}, heartbeat "
              f"{format_age(time.time() - lease.heartbeat)} ago ({state})")
    checkpoints = list_checkpoints(root / CHECKPOINTS)
    print(f"checkpoints ({'sizes checked' if quick else 'sha256 verified'}):" if checkpoints
          else "checkpoints: none")
    newest_valid = None
    for step, path in checkpoints:
        problem = verify_folder(path, hashes=not quick)
        try:
            manifest = read_manifest(path)
            detail = f"{format_bytes(manifest.total_bytes):>10}  saved {format_age(time.time() - manifest.created)} ago"
        except ValueError:
            detail = f"{'':>10}  {'':<16}"
        verdict = "valid" if problem is None else f"INVALID: {problem}"
        if problem is None and newest_valid is None:
            newest_valid = step
        print(f"  {path.name:<20} {detail}  {verdict}")
    if checkpoints:
        print(f"resume would use: checkpoint-{newest_valid}" if newest_valid is not None
              else "resume would start fresh: no checkpoint verifies")
    journal = read_events(root / EVENTS)
    if journal:
        print(f"last {min(events, len(journal))} of {len(journal)} events:")
        for event in journal[-events:]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.get("time", 0)))
            fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "time"))
            print(f"  {when}  {event['event']:<8} {fields[:160]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colab_kit",
                                     description="colab_kit: durable fine-tuning runs for Colab.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="execute a notebook headless (papermill)")
    p_run.add_argument("notebook")
    p_run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                       help="set a value of the notebook's parameters cell (Python literal or text)")
    p_run.add_argument("-o", "--output", help="where to write the executed notebook (default outputs/NAME)")
    p_run.add_argument("--timeout", type=int, default=None, help="seconds allowed per cell")
    p_status = sub.add_parser("status", help="show what a run folder holds")
    p_status.add_argument("run_dir")
    p_status.add_argument("-n", "--events", type=int, default=10, help="how many recent events to show")
    p_status.add_argument("--quick", action="store_true", help="check sizes only, skip sha256")
    sub.add_parser("demo", help="a tiny training run through the kit (CPU, under a minute); "
                               "`demo --help` lists its options", add_help=False)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "run":
        params = {name: _literal(value) for name, value in args.parameter}
        return run_notebook(args.notebook, params, args.output, args.timeout)
    if args.command == "status":
        return show_status(args.run_dir, args.events, args.quick)
    from .demo import main as demo_main

    return demo_main(extra)
