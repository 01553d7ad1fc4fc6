"""The gauges as a person sees them (issue 49): the RNA notebook's quick preset in a real JupyterLab 3 with Colab's
widget stack (ipywidgets 7.7.1 and its JupyterLab frontend, jupyterlab_widgets 1.x), in headless Chromium, Run >
Run All Cells clicked in the menu. From the page's DOM: (a) the gauge widget's numbers change while the training
cell runs, and (b) the gauges' summary is in the cell's output once the cell has ended, stays there while the
rest of the notebook runs, and is still there after the notebook is saved and the page reloaded.

The kernel tests (tests/gauges/test_gauges_kernel.py) check the messages a kernel sends; this one checks what a
browser draws from them. It needs Debian's chromium and chromium-driver and requirements-browser-test.txt, which
`.ci/browser` installs (into a copy of the test venv: the pins take ipywidgets down to 7); the README's test
command skips it, saying so, and under `.ci/browser` (COLAB_KIT_REQUIRE_BROWSER=1) a skip is a failure.
Screenshots go to $COLAB_KIT_BROWSER_SHOTS (the test's temporary folder otherwise); among them `gauges.png`, the
gauge widget alone mid-run, and `gauges_summary.png`, the summary alone: docs/gauges.png and docs/gauges_summary.png
(the README's picture) are copied from a CI run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "rna_bert_classification.ipynb"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
TRAIN_MARKER = "run.train(trainer)"  # the training cell's source contains this, and no other cell's
RUN_LIMIT = 900  # seconds for Run All (33-160 s measured on 2 cores, with other work beside it)


def _installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def _why_not_here() -> str | None:
    """Why this machine cannot run the test, or None. The widget stack is the test's interpreter's, which is
    also the kernel's (JupyterLab starts its kernel with the interpreter it runs on)."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        return "Chromium and its driver are missing (Debian: apt-get install -y chromium chromium-driver)"
    stack = {name: _installed(name) for name in ("ipywidgets", "jupyterlab", "jupyterlab_widgets", "selenium")}
    if (stack["ipywidgets"] != "7.7.1" or not stack["jupyterlab"].startswith("3.")
            or not stack["jupyterlab_widgets"].startswith("1.") or stack["selenium"] == "absent"):
        return (f"needs Colab's widget stack in JupyterLab 3 (requirements-browser-test.txt), here {stack}")
    return None


@pytest.fixture(scope="module", autouse=True)
def a_browser_and_colabs_widgets():
    why = _why_not_here()
    if why is None:
        return
    if os.environ.get("COLAB_KIT_REQUIRE_BROWSER"):  # set by .ci/browser, which installs all of it
        pytest.fail(f"COLAB_KIT_REQUIRE_BROWSER is set, but {why}")
    pytest.skip(f"the gauges in a real browser: {why}; .ci/browser installs it and runs this test")


STATE_JS = r"""
const marker = arguments[0];
const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell.jp-CodeCell')];
const src = c => (c.querySelector('.jp-InputArea-editor') || {}).innerText || '';
const train = cells.find(c => src(c).includes(marker));
const visible = e => !e.closest('.lm-mod-hidden, .p-mod-hidden');
const sb = (document.querySelector('#jp-main-statusbar') || {}).innerText || '';
const out = train ? train.querySelector('.jp-Cell-outputArea') : null;
return {
  prompts: cells.map(c => ((c.querySelector('.jp-InputPrompt') || {}).innerText || '').trim()),
  kernel: (sb.match(/\|\s*(Idle|Busy|Starting|Restarting|Connecting|Unknown|Disconnected|Dead)/) || [])[1] || '',
  found: !!train,
  train_prompt: train ? ((train.querySelector('.jp-InputPrompt') || {}).innerText || '').trim() : '',
  gauge: out ? [...out.querySelectorAll('.jupyter-widgets .widget-html-content')].filter(visible)
                 .map(e => e.innerText) : [],
  html: out ? [...out.querySelectorAll('.jp-RenderedHTML')].map(e => e.innerText) : [],
  widget_text: out ? [...out.querySelectorAll('.jupyter-widgets')].filter(visible).map(e => e.innerText)
                       .join('\n') : '',
  errors: [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
            .map(e => e.innerText).filter(t => t.includes('Traceback (most recent call last)'))
            .map(t => t.slice(-1500)),
};
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_notebook(workdir: Path) -> Path:
    """The notebook with papermill's injected-parameters cell (PRESET quick, DRIVE_DIR a local folder), not run."""
    import papermill

    out = workdir / "rna.ipynb"
    papermill.execute_notebook(str(NOTEBOOK), str(out), prepare_only=True, log_output=False, progress_bar=False,
                               parameters={"PRESET": "quick", "DRIVE_DIR": str(workdir / "drive")})
    return out


@contextlib.contextmanager
def jupyterlab(workdir: Path, home: Path):
    """JupyterLab on a free port: no token, no browser, root allowed, its settings and state in `home`."""
    port = free_port()
    settings = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # No "Would you like to receive official Jupyter news?" toast over the notebook, no update check.
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               JUPYTERLAB_SETTINGS_DIR=str(home / "lab-settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               # No user-level kernelspec can shadow this venv's python3 (its argv "python" becomes sys.executable).
               JUPYTER_DATA_DIR=str(home / "data"),
               IPYTHONDIR=str(home / "ipython"), MPLBACKEND="module://matplotlib_inline.backend_inline")
    env.pop("COLAB_KIT_DRIVE", None)
    log = open(home / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         "--ServerApp.port_retries=0", "--ServerApp.token=", "--ServerApp.password=",
         f"--ServerApp.root_dir={workdir}", "--LabApp.news_url=None"],
        cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("JupyterLab did not start:\n" + (home / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(Exception):  # shut the kernels down through the server, then the server
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/shutdown", method="POST"), timeout=10)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the server and the kernels it started
            proc.wait()
        log.close()


@contextlib.contextmanager
def chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit chromedriver: selenium-manager would otherwise try to download one.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def click_menu(driver, menu: str, command: str) -> None:
    """Open the menu bar's `menu` and click the item for JupyterLab command `command`, as a person does."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 20)
    item = wait.until(EC.element_to_be_clickable(
        (By.XPATH, f"//li[contains(@class,'lm-MenuBar-item')][.//div[normalize-space()='{menu}']]")))
    item.click()
    wait.until(EC.element_to_be_clickable(
        (By.CSS_SELECTOR, f'.lm-Menu-item[data-command="{command}"]'))).click()


def state(driver) -> dict:
    return driver.execute_script(STATE_JS, TRAIN_MARKER)


class Camera:
    """Screenshots of the page, scrolled to the training cell, into one folder."""

    def __init__(self, driver, folder: Path):
        self.driver, self.folder, self.taken = driver, folder, []

    def page(self, name: str, scroll_to_train: bool = True) -> None:
        if scroll_to_train:
            self.driver.execute_script(
                "const c=[...document.querySelectorAll('.jp-Notebook .jp-CodeCell')].find(c=>(c.querySelector("
                "'.jp-InputArea-editor')||{}).innerText?.includes(arguments[0]));"
                "if(c){(c.querySelector('.jp-Cell-outputArea')||c).scrollIntoView({block:'center'});}",
                TRAIN_MARKER)
            time.sleep(0.3)
        self.driver.save_screenshot(str(self.folder / f"{name}.png"))  # the viewport only: hence the scroll
        self.taken.append(name)

    def part_of_training_cell(self, name: str, css: str, containing: str = "") -> None:
        """One element of the training cell's output alone (the docs' pictures), as the browser drew it: the
        first that matches `css` (the outermost, in document order) and holds the text `containing`."""
        from selenium.webdriver.common.by import By

        cells = self.driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")
        train = next(c for c in cells if TRAIN_MARKER in c.find_element(By.CSS_SELECTOR, ".jp-InputArea-editor").text)
        part = next(e for e in train.find_elements(By.CSS_SELECTOR, f".jp-Cell-outputArea {css}")
                    if containing in e.text)
        part.screenshot(str(self.folder / f"{name}.png"))
        self.taken.append(name)


def wait_for_notebook(driver, timeout=90) -> dict:
    """The notebook's cells rendered and its kernel idle."""
    deadline = time.monotonic() + timeout
    while True:
        s = state(driver)
        if s["found"] and s["kernel"] == "Idle":
            return s
        assert time.monotonic() < deadline, f"notebook not ready after {timeout} s: {s}"
        time.sleep(0.5)


STEP = re.compile(r"step (\d+)/(\d+)")
# The host RAM bar's value, "5.4 GiB / 23.5 GiB (this process 903.4 MiB)" (the GPU bars say "n/a" on a CPU machine).
RAM = re.compile(r"host RAM\s+([\d.]+ \w+ / [\d.]+ \w+ \(this process [^)]*\))")


def poll_run_all(driver, camera: Camera, t0: float, timeline: list, ram_seen: set) -> None:
    """Poll the page once a second until Run All is over, recording the gauge and taking the screenshots."""
    done_since = None
    while True:
        now = time.monotonic() - t0
        s = state(driver)
        assert not s["errors"], f"a cell failed:\n{s['errors'][0]}"
        assert s["kernel"] not in ("Dead", "Restarting"), f"the kernel died: {s['prompts']}"
        assert "Error displaying widget" not in s["widget_text"], s["widget_text"]
        line = s["gauge"][0].split("\n")[0] if s["gauge"] else ""
        has_summary = any("colab_kit gauges summary" in h for h in s["html"])
        timeline.append((now, s["train_prompt"], line, has_summary, sum("*" in p for p in s["prompts"])))
        step = STEP.search(line)
        ram_seen.update(RAM.findall(s["gauge"][0]) if s["gauge"] else [])
        if step and "02-gauge-first" not in camera.taken:
            camera.page("02-gauge-first")
        if step and int(step[1]) * 2 >= int(step[2]) and "03-gauge-mid" not in camera.taken:
            camera.page("03-gauge-mid")
            with contextlib.suppress(Exception):  # the widget may close in between: then no picture of it
                camera.part_of_training_cell("gauges", ".jupyter-widgets")
        if has_summary and "04-summary" not in camera.taken:
            camera.page("04-summary")
            camera.part_of_training_cell("gauges_summary", ".jp-RenderedHTML", "colab_kit gauges summary")
        # Run All is over when the kernel is idle and no cell is queued or running ([*]) for 3 s.
        finished = s["kernel"] == "Idle" and not any("*" in p for p in s["prompts"]) and now > 5
        done_since = (done_since or now) if finished else None
        if done_since is not None and now - done_since >= 3:
            break
        assert now < RUN_LIMIT, f"Run All still going after {RUN_LIMIT} s: {s['prompts']}"
        time.sleep(1.0)


@pytest.fixture
def shots(tmp_path) -> Path:
    folder = Path(os.environ.get("COLAB_KIT_BROWSER_SHOTS") or tmp_path / "shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.timeout(1200)
def test_gauges_live_in_jupyterlab_and_the_summary_stays(tmp_path, shots):
    workdir, home = tmp_path / "work", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    nb = prepare_notebook(workdir)
    # (seconds since Run All, the training cell's prompt, the gauge's status line, summary shown, cells still to run)
    timeline: list[tuple[float, str, str, bool, int]] = []
    started = time.monotonic()
    with jupyterlab(workdir, home) as url, chromium() as driver:
        camera = Camera(driver, shots)
        driver.get(f"{url}/lab/tree/{nb.name}?reset")  # ?reset: the default workspace, whatever was saved
        wait_for_notebook(driver)
        click_menu(driver, "View", "application:toggle-left-area")  # hide the file browser: a wider notebook
        camera.page("01-opened", scroll_to_train=False)

        click_menu(driver, "Run", "runmenu:run-all")  # Run > Run All Cells
        t0 = time.monotonic()
        ram_seen: set[str] = set()
        try:
            poll_run_all(driver, camera, t0, timeline, ram_seen)
        finally:  # what was seen, also when it failed
            (shots / "timeline.json").write_text(json.dumps(timeline, indent=0))
            (shots / "browser-console.json").write_text(json.dumps(driver.get_log("browser"), indent=1))
            shutil.copy(home / "jupyterlab.log", shots / "jupyterlab.log")
            camera.page("05-finished")
        run_all = time.monotonic() - t0
        final = state(driver)

        # Every code cell ran, in order: [1] ... [n] (a failed cell would leave the ones after it "[ ]:").
        assert final["prompts"] == [f"[{i}]:" for i in range(1, len(final["prompts"]) + 1)], final["prompts"]

        # (a) the widget's numbers changed while the training cell ran ([*]).
        live = [line for _, prompt, line, _, _ in timeline if prompt == "[*]:" and STEP.search(line)]
        steps = [int(STEP.search(line)[1]) for line in live]
        assert len(set(steps)) >= 5, f"the gauge's step changed only {len(set(steps))} times: {live[:5]}"
        assert steps == sorted(steps) and steps[-1] > steps[0], steps
        total = int(STEP.search(live[0])[2])
        assert steps[-1] >= total // 2, (steps[-1], total)  # seen well into the run, not just at its start
        assert any("loss" in line for line in live), "no loss shown in the gauge's status line"
        assert len(ram_seen) >= 2, f"the host RAM gauge never changed: {ram_seen}"

        # (b) once the cell has ended: the live widget is gone, its static summary is in the output.
        assert not final["gauge"], f"the live widget is still shown: {final['gauge']}"
        summaries = [h for h in final["html"] if "colab_kit gauges summary" in h]
        assert len(summaries) == 1, final["html"]
        summary = summaries[0]
        assert "finished" in summary and "peak host RAM" in summary and "final loss" in summary, summary
        assert re.search(r"steps\s+%d\b" % total, summary), summary  # all the quick preset's steps
        # It appeared while the cells after the training cell were still queued or running, and stayed in every
        # poll from then on, through the rest of Run All.
        first = next(i for i, entry in enumerate(timeline) if entry[3])
        assert timeline[first][4] > 0, "the summary only appeared once the whole notebook had run"
        assert all(entry[3] for entry in timeline[first:]), "the summary vanished after it was shown"

        # (b, continued) saved (File > Save Notebook) and the page reloaded: the summary is still there.
        click_menu(driver, "File", "docmanager:save")
        time.sleep(2)
        driver.refresh()
        wait_for_notebook(driver)
        time.sleep(2)  # widgets' renderers settle
        reloaded = state(driver)
        camera.page("06-after-reload")
        assert any("colab_kit gauges summary" in h for h in reloaded["html"]), reloaded["html"]
        print(f"\nRun All {run_all:.0f} s; whole test {time.monotonic() - started:.0f} s; gauge steps seen "
              f"{sorted(set(steps))[:3]}...{sorted(set(steps))[-3:]} of {total}; screenshots {camera.taken} "
              f"in {shots}")
