"""The command line (`python -m colab_kit`, or `colab-kit`): run a notebook headless, inspect a run
folder, measure Drive, or run the demo.

    python -m colab_kit run notebooks/rna_bert_classification.ipynb -p PRESET quick
    python -m colab_kit status drive/rna-bert
    python -m colab_kit status hf://alice/colab-runs/rna-bert
    python -m colab_kit drive-check /content/drive/MyDrive
    python -m colab_kit demo
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _literal(text: str):
    """`-p MAX_STEPS 20` -> 20, `-p DRIVE_DIR None` -> None, `-p PRESET quick` -> "quick"."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _kernel_manager_class():
    """The kernel manager for a headless run: IPC transport, its sockets beside the connection file in
    Jupyter's runtime folder (not in the working folder, which may be a Drive mount). ipykernel 7 warns at
    every start that a kernel on TCP without CurveZMQ keys "is susceptible to eavesdropping"; a headless
    run on one machine needs no network at all."""
    import uuid

    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.paths import jupyter_runtime_dir

    class IpcKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            runtime = Path(jupyter_runtime_dir())
            runtime.mkdir(parents=True, exist_ok=True)
            kwargs.setdefault("transport", "ipc")
            kwargs.setdefault("connection_file", str(runtime / f"kernel-{uuid.uuid4().hex[:12]}.json"))
            super().__init__(**kwargs)

        async def _async_interrupt_kernel(self):
            # jupyter_client 8 interrupts the kernel before asking it to shut down. A headless run's cells
            # have all ended by then; a SIGINT that lands while the kernel still finishes its last message
            # makes it print "KeyboardInterrupt caught in kernel" into the job's output (seen 1 run in 28).
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

    return IpcKernelManager


def run_notebook(notebook: str, parameters: dict, output: str | None, timeout: int | None) -> int:
    # ipykernel 6 (Colab's 6.17.1) imports the debugger in this process and in the kernel, and on Python
    # 3.11+ the debugger warns that frozen modules "may make the debugger miss breakpoints". Nothing here
    # debugs: its own setting turns that check off (set before ipykernel is imported; the kernel inherits it).
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
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
                                   log_output=True, progress_bar=False, execution_timeout=timeout,
                                   kernel_manager_class=_kernel_manager_class())
    except papermill.PapermillExecutionError as exc:
        print(f"\nthe notebook failed in cell {exc.exec_count}: {exc.ename}: {exc.evalue}\n"
              f"see {out} for the full output", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - started:.0f} s; output notebook: {out}")
    from .run.status import headline

    for line in headline(out):
        print(line)
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
    p_status = sub.add_parser("status", help="show what a run folder (or a run on the Hub) holds")
    p_status.add_argument("run_dir", help="the run folder, or hf://<user>/<repo>/<run> for a run on the Hub")
    p_status.add_argument("-n", "--events", type=int, default=10, help="how many recent events to show")
    p_status.add_argument("--quick", action="store_true", help="check sizes only, skip sha256")
    p_check = sub.add_parser("drive-check", help="measure what Drive reports about uploads (prints JSON)")
    p_check.add_argument("folder", nargs="?", default=None,
                         help="a folder on the Drive mount (default: the kit's folder, MyDrive/colab_kit in Colab)")
    p_check.add_argument("--size-mb", type=float, default=100, help="size of the test file (default 100)")
    p_check.add_argument("--interval", type=float, default=1.0, help="seconds between attribute reads")
    p_check.add_argument("--timeout", type=float, default=900, help="seconds to wait for the upload")
    sub.add_parser("demo", help="a tiny training run through the kit (CPU, under a minute); "
                               "`demo --help` lists its options", add_help=False)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "run":
        params = {name: _literal(value) for name, value in args.parameter}
        return run_notebook(args.notebook, params, args.output, args.timeout)
    if args.command == "status":
        from .run.status import show_status

        return show_status(args.run_dir, args.events, args.quick)
    if args.command == "drive-check":
        from .drive.drivecheck import drive_check

        drive_check(args.folder, size_mb=args.size_mb, interval=args.interval, timeout=args.timeout)
        return 0
    from .tasks.demo import main as demo_main

    return demo_main(extra)


if __name__ == "__main__":
    sys.exit(main())
