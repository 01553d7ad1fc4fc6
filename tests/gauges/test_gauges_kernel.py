"""The gauges in a real IPython kernel: live widget updates while a cell runs, a summary that stays.

Run once with the installed ipywidgets (8.x) and once with Colab's 7.7.1, fetched from PyPI
into pytest's cache and put first on the kernel's PYTHONPATH.
"""

import importlib.metadata
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

CELL = """
import time, colab_kit as ck
with ck.Gauges(total_steps=40, title="kernel test") as g:
    for step in range(40):
        end = time.perf_counter() + 0.12
        while time.perf_counter() < end:  # a busy training step
            pass
        g.update(step=step + 1, loss=1.0 / (step + 1))
import ipywidgets
print("ipywidgets", ipywidgets.__version__)
"""


@pytest.fixture(scope="session")
def ipywidgets_7(request, shared_tmp):
    # Kept in pytest's cache between runs; in this session's folder where the cache is off (-p no:cacheprovider).
    cache = getattr(request.config, "cache", None)
    target = cache.mkdir("ipywidgets-7.7.1") if cache is not None else shared_tmp / "ipywidgets-7.7.1"
    if not (target / "ipywidgets" / "__init__.py").exists():
        pins = ["ipywidgets==7.7.1", "widgetsnbextension==3.6.1", "jupyterlab_widgets==1.1.1", "ipython_genutils==0.2.0"]
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *pins],
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"could not fetch Colab's ipywidgets 7.7.1 from PyPI:\n{proc.stderr[-2000:]}"
    return target


def run_cell(kc, code, timeout=180):
    msg_id = kc.execute(code)
    messages = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return messages


@pytest.mark.parametrize("version", ["installed", "7.7.1"])
def test_live_widget_updates_while_the_cell_runs_and_a_summary_stays(version, request):
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ)
    if version == "7.7.1":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(request.getfixturevalue("ipywidgets_7")),
                                                          env.get("PYTHONPATH")]))
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    try:
        messages = run_cell(kc, CELL)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    errors = [m["content"] for m in messages if m["msg_type"] == "error"]
    assert not errors, errors
    printed = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")
    expected = "7.7.1" if version == "7.7.1" else importlib.metadata.version("ipywidgets")  # 7.7.1 in Colab's venv
    assert f"ipywidgets {expected}\n" in printed, printed
    opened = [m for m in messages if m["msg_type"] == "comm_open"]
    assert any(m["content"]["data"]["state"].get("_model_name") == "HTMLModel" for m in opened)
    shown = [m for m in messages if m["msg_type"] == "display_data"
             and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
    assert len(shown) == 1
    updates = [m for m in messages if m["msg_type"] == "comm_msg"
               and "value" in m["content"]["data"].get("state", {})]
    assert len(updates) >= 3, f"only {len(updates)} live updates arrived while the cell ran"
    assert any("step 2" in u["content"]["data"]["state"]["value"] or "step 3" in u["content"]["data"]["state"]["value"]
               for u in updates)
    final = [m for m in messages if m["msg_type"] == "display_data" and "text/html" in m["content"]["data"]]
    assert final and "colab_kit gauges summary" in final[-1]["content"]["data"]["text/html"]
    assert "step" in final[-1]["content"]["data"]["text/html"] and "peak host RAM" in final[-1]["content"]["data"]["text/html"]
