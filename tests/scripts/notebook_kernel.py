"""A real Jupyter kernel driven through one of the project's notebooks as a person drives it (issue 28): cells
run one at a time, run again, changed, stopped with the stop button, two kernels on one run.

It speaks to the kernel with `jupyter_client`, as Jupyter's and Colab's frontends do: an `execute_request`
per cell, the cell's output read from the iopub channel until the kernel is idle again, and the stop button
as the frontend's interrupt (`KernelManager.interrupt_kernel`: SIGINT to the kernel).
"""

from __future__ import annotations

import json
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jupyter_client import KernelManager


@dataclass
class Ran:
    """What one cell printed (stdout, stderr, results, tracebacks' last lines), and how it ended."""

    text: str
    error: str | None  # "KeyboardInterrupt: ...", or None when the cell ended normally
    seconds: float
    presses: int = 0  # stop presses sent while it ran

    def __str__(self) -> str:
        return self.text + (f"\n[{self.error}]" if self.error else "")


class NotebookKernel:
    """One kernel (cwd `workdir`) and one notebook's code cells. `params` are set right after the parameters
    cell, as papermill's injected cell does (PRESET "quick" and DRIVE_DIR `workdir/drive` unless given)."""

    def __init__(self, notebook: Path, workdir: Path, **params):
        self.workdir = Path(workdir)
        self.cells = [("".join(c["source"]), c["metadata"].get("tags", []))
                      for c in json.loads(Path(notebook).read_text())["cells"] if c["cell_type"] == "code"]
        self.params = {"PRESET": "quick", "DRIVE_DIR": str(self.workdir / "drive"), **params}
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("COLAB_KIT_DRIVE", None)
        env.pop("COLAB_KIT_WARM_FORKSERVER", None)
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(self.workdir), env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        self.ran: list[tuple[str, Ran]] = []  # (what, result) in order: the transcript a failed test prints

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

    def __enter__(self) -> "NotebookKernel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- cells -----------------------------------------------------------------------------------
    def index(self, marker: str) -> int:
        """The code cell whose source contains `marker` (exactly one must)."""
        hits = [i for i, (source, _) in enumerate(self.cells) if marker in source]
        assert len(hits) == 1, f"{len(hits)} code cells contain {marker!r}"
        return hits[0]

    def run_cell(self, marker: str, **kw) -> Ran:
        """Run the cell that contains `marker`."""
        return self._run(self.index(marker), marker, **kw)

    def run_through(self, marker: str, *, upto: bool = False, **kw) -> Ran:
        """Run every code cell from the top to the one containing `marker` (`upto`: the one before it),
        stopping at the first that fails; returns the last one run (`kw` goes to it)."""
        last = self.index(marker) - (1 if upto else 0)
        ran = None
        for i in range(last + 1):
            ran = self._run(i, f"cell {i}", **(kw if i == last else {}))
            if ran.error is not None:
                break
        return ran

    def _run(self, i: int, what: str, **kw) -> Ran:
        """Run code cell `i`; the parameters cell is followed by the overrides, as papermill does it."""
        source, tags = self.cells[i]
        ran = self.execute(source, what=what, **kw)
        if "parameters" in tags and ran.error is None:
            self.set(**self.params)
        return ran

    def set(self, **params) -> Ran:
        """Change parameters, as a person editing the parameters cell does (run the cells that use them next)."""
        self.params.update(params)
        ran = self.execute("\n".join(f"{name} = {value!r}" for name, value in params.items()), what="set")
        assert ran.error is None, ran
        return ran

    # -- the kernel ------------------------------------------------------------------------------
    def execute(self, code: str, *, what: str = "code", stop_when: Callable[[], bool] | None = None,
                presses: int = 1, meanwhile: Callable[[], None] | None = None, timeout: float = 600) -> Ran:
        """Run `code` and read its output until the kernel is idle. `stop_when`: polled while it runs; once
        true, the stop button is pressed `presses` times (a second after the first). `meanwhile`: called at
        every poll (what happens around the kernel while the cell runs)."""
        msg_id = self.client.execute(code, allow_stdin=False)
        text, error, pressed = [], None, 0
        started = time.monotonic()
        next_press = None
        while True:
            if time.monotonic() - started > timeout:
                self.manager.interrupt_kernel()
                raise AssertionError(f"{what} ran over {timeout} s; printed:\n{''.join(text)[-4000:]}")
            if pressed < presses and stop_when is not None and (next_press or stop_when()):
                if next_press is None or time.monotonic() >= next_press:
                    self.manager.interrupt_kernel()
                    pressed += 1
                    next_press = time.monotonic() + 1.0
            if meanwhile is not None:
                meanwhile()
            try:
                msg = self.client.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                text.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                break
        ran = Ran("".join(text), error, time.monotonic() - started, pressed)
        self.ran.append((what, ran))
        return ran

    def transcript(self) -> str:
        """Everything run so far and what it printed (for a failed assertion's message)."""
        return "\n".join(f"--- {what} ({ran.seconds:.1f} s)\n{ran}" for what, ran in self.ran)[-12000:]
