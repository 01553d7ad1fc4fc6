"""Render the live gauges of a real run, the RNA notebook's quick preset in JupyterLab, in headless
Chromium, and save PNG screenshots.

    pip install jupyterlab playwright      # dev tools, not needed to use the kit
    apt-get install chromium               # Debian's Chromium at /usr/bin/chromium
    python scripts/render_gauges.py        # writes docs/gauges.png and docs/gauges_summary.png

The notebook runs with PRESET="quick" chosen in its form, in a folder of its own, with "Run All
Cells" as a user would: the gauges are screenshotted while the training cell runs and the summary once it
stays. On a machine without a GPU the gauges show none: what is there is the CPU run's own (host RAM,
steps, loss, checkpoints and the cloud line).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "rna_bert_classification.ipynb"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    parser.add_argument("--at", type=float, default=0.6, help="the share of the steps done at the screenshot")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="gauges-lab-"))
    text = NOTEBOOK.read_text()
    if text.count('PRESET = \\"full\\"') != 1:
        raise SystemExit("the RNA notebook's PRESET line changed: update render_gauges.py")
    (work / NOTEBOOK.name).write_text(text.replace('PRESET = \\"full\\"', 'PRESET = \\"quick\\"'))  # the form
    port, token = free_port(), secrets.token_hex(16)
    lab = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
                            f"--ServerApp.token={token}", f"--ServerApp.root_dir={work}", "--ServerApp.ip=127.0.0.1",
                            "--allow-root"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, JUPYTER_PLATFORM_DIRS="1"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"])
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.goto(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK.name}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.add_style_tag(content=".Toastify { display: none !important; }")  # JupyterLab's news prompt
            time.sleep(3)  # the kernel starts
            page.click("text=Run", timeout=30_000)
            page.click("text=Run All Cells", timeout=30_000)
            # The gauges, not another HTML widget (datasets' progress bars): the status line has a rate.
            gauges = page.locator(".jp-OutputArea-output").filter(has=page.locator(".widget-html",
                                                                                    has_text="steps/s")).last
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                done = re.search(r"step (\d+)/(\d+)", gauges.inner_text() if gauges.count() else "")
                if done and int(done.group(1)) >= args.at * int(done.group(2)):
                    break
                time.sleep(0.2)
            else:
                raise SystemExit("the gauges did not reach the asked share of the steps in 15 minutes")
            gauges.scroll_into_view_if_needed()
            gauges.screenshot(path=str(out / "gauges.png"))
            page.wait_for_selector("text=colab_kit gauges summary", timeout=900_000)
            time.sleep(1)
            summary = page.locator(".jp-OutputArea-output").filter(has_text="colab_kit gauges summary").last
            summary.scroll_into_view_if_needed()
            summary.screenshot(path=str(out / "gauges_summary.png"))
            browser.close()
    finally:
        lab.terminate()
        lab.wait(timeout=30)
    print(f"wrote {out / 'gauges.png'} and {out / 'gauges_summary.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
