"""In a real IPython kernel, an uncaught OOM keeps the failing frames alive until free_memory()."""

import pytest

pytestmark = pytest.mark.slow


def run_cell(kc, code: str, timeout: float = 120) -> dict:
    msg_id = kc.execute(code)
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    outputs = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            outputs.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return {"status": reply["content"]["status"], "ename": reply["content"].get("ename"),
            "stdout": "".join(outputs)}


def test_free_memory_releases_the_tensors_of_a_cell_that_died_of_oom():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        setup = run_cell(kc, "import gc, weakref, torch, colab_kit as ck\n"
                             "refs = []\n"
                             "def train_step():\n"
                             "    activations = torch.zeros(1 << 20)  # held by this frame only\n"
                             "    refs.append(weakref.ref(activations))\n"
                             "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 4.00 MiB')\n")
        assert setup["status"] == "ok", setup
        died = run_cell(kc, "train_step()")
        assert died["status"] == "error" and died["ename"] == "OutOfMemoryError"
        held = run_cell(kc, "gc.collect(); print('alive' if refs[0]() is not None else 'freed')")
        assert held["stdout"].strip() == "alive"  # IPython keeps the traceback, and so the frame
        freed = run_cell(kc, "report = ck.free_memory()\n"
                             "print('alive' if refs[0]() is not None else 'freed', report['dropped_references'])")
        state, dropped = freed["stdout"].strip().splitlines()[-1].split()
        assert state == "freed" and int(dropped) >= 2
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
