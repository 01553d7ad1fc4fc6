"""Render the live gauges in JupyterLab in headless Chromium and save PNG screenshots.

    pip install jupyterlab playwright      # dev tools, not needed to use the kit
    apt-get install chromium               # Debian's Chromium at /usr/bin/chromium
    python scripts/render_gauges.py        # writes docs/gauges.png and docs/gauges_summary.png

A notebook runs a training loop with `ck.Gauges`. Without a GPU on the machine, NVML is
replaced by a stand-in that reports a T4 filling up, and the title says so; host RAM, the
sparklines and everything else are real.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETUP = '''\
import sys, types, time, math
import colab_kit as ck
# No GPU here: a stand-in NVML reporting a T4 (15 GiB) that fills up as training runs.
t0 = time.time()
def _used(h):
    used = min(14.2, 2.5 + 1.6 * (time.time() - t0)) * 2**30
    return types.SimpleNamespace(total=15 * 2**30, used=int(used), free=int(15 * 2**30 - used))
sys.modules["pynvml"] = types.SimpleNamespace(
    nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 1,
    nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetMemoryInfo=_used,
    nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=int(85 + 10 * math.sin(time.time()))),
    NVML_TEMPERATURE_GPU=0, nvmlDeviceGetTemperature=lambda h, s: 67, nvmlDeviceGetPowerUsage=lambda h: 61000)
'''
TRAIN = '''\
g = ck.Gauges(total_steps=300, title="demo · simulated T4 (stand-in NVML)", interval=0.5)
ballast = []
for step in range(1, 121):
    end = time.perf_counter() + 0.1
    while time.perf_counter() < end:
        pass
    ballast.append(bytearray(4 * 2**20))  # host RAM grows, as a leaky data pipeline would
    g.update(step=step, loss=2.5 * math.exp(-step / 40) + 0.3 + 0.05 * math.sin(step),
             saved_step=100 if step >= 100 else None,
             cloud="in the cloud: 100 (1 min old)" if step >= 108 else "nothing in the cloud yet")
g.close()
'''


def notebook(path: Path) -> None:
    cells = [{"cell_type": "code", "metadata": {}, "source": SETUP, "outputs": [], "execution_count": None},
             {"cell_type": "code", "metadata": {}, "source": TRAIN, "outputs": [], "execution_count": None}]
    path.write_text(json.dumps({"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                             "language": "python"}},
                                "nbformat": 4, "nbformat_minor": 5}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="gauges-lab-"))
    notebook(work / "gauges.ipynb")
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
            page.goto(f"http://127.0.0.1:{port}/lab/tree/gauges.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.add_style_tag(content=".Toastify { display: none !important; }")  # JupyterLab's news prompt
            time.sleep(3)  # the kernel starts
            page.click("text=Run", timeout=30_000)
            page.click("text=Run All Cells", timeout=30_000)
            page.wait_for_selector(".widget-html", timeout=120_000)
            time.sleep(8)
            widget = page.locator(".jp-OutputArea-output").filter(has=page.locator(".widget-html")).first
            widget.screenshot(path=str(out / "gauges.png"))
            page.wait_for_selector("text=colab_kit gauges summary", timeout=120_000)
            time.sleep(1)
            summary = page.locator(".jp-OutputArea-output").filter(has_text="colab_kit gauges summary").first
            summary.screenshot(path=str(out / "gauges_summary.png"))
            browser.close()
    finally:
        lab.terminate()
        lab.wait(timeout=30)
    print(f"wrote {out / 'gauges.png'} and {out / 'gauges_summary.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
